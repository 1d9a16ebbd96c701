"""`vllm serve MODEL --omni`: start the OpenAI-compatible vllm-omni server on an `AsyncOmni` engine."""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli.types import CLISubcommand
from vllm.entrypoints.launchers.cli_args import FrontendArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_omni.engine.arg_utils import OmniEngineArgs
from vllm_omni.entrypoints.cli.main import SERVE_HELP
from vllm_omni.inputs.data import DiffusionLimits

DESCRIPTION = """Launch the vllm-omni OpenAI-compatible server for MODEL (a Hugging Face id, a local path,
or a built-in tiny default such as tiny/qwen-image or tiny/qwen2).

Routes: /v1/chat/completions (+ /batch), /v1/images/generations, /v1/images/edits, /v1/audio/speech,
/v1/models, /health, /metrics, /v1/omni/sleep, /v1/omni/wakeup.
Use `--help=<group>` (e.g. --help=OmniConfig, --help=Frontend) or `--help=all` for every flag.
"""


def add_omni_frontend_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="OmniFrontend", description="vllm-omni HTTP server options.")
    group.add_argument("--max-upload-mb", type=float, default=20.0,
                       help="Largest accepted upload (image edits) in MiB; larger ones get 413.")
    group.add_argument("--max-request-outputs", type=int, default=8,
                       help="Most images/videos one request may ask for (n / num_outputs_per_prompt).")
    # Request bounds, checked in the API process before anything is queued (4xx naming the field).
    limits = DiffusionLimits()
    group.add_argument("--max-request-body-mb", type=float, default=32.0,
                       help="Largest accepted request body in MiB (multipart uploads: --max-upload-mb + 1); "
                            "larger ones get 413 before they are read.")
    group.add_argument("--max-inference-steps", type=int, default=limits.max_inference_steps,
                       help="Most denoise steps (num_inference_steps) one diffusion request may ask for.")
    group.add_argument("--max-num-frames", type=int, default=limits.max_num_frames,
                       help="Most video frames (num_frames, or seconds x fps) one request may ask for.")
    group.add_argument("--max-output-pixels", type=int, default=limits.max_output_pixels,
                       help="Most output pixels (width x height) per image or video frame.")
    group.add_argument("--max-input-image-pixels", type=int, default=4096 * 4096,
                       help="Most pixels of an input image, read from its header before it is decoded.")
    return parser


def make_omni_arg_parser(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    parser.add_argument("model_tag", type=str, nargs="?", help="The model to serve.")
    parser = FrontendArgs.add_cli_args(parser)
    parser = OmniEngineArgs.add_cli_args(parser)
    return add_omni_frontend_args(parser)


class OmniServeCommand(CLISubcommand):
    """The `serve` subcommand of the vllm-omni CLI."""

    name = "serve"

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        import uvloop

        from vllm_omni.entrypoints.openai.api_server import run_server

        if args.model_tag is not None:
            args.model = args.model_tag
        uvloop.run(run_server(args))

    def validate(self, args: argparse.Namespace) -> None:
        if args.model_tag is None and getattr(args, "model", None) is None:
            raise SystemExit("vllm-omni serve: a MODEL is required (e.g. `vllm serve tiny/qwen-image --omni`)")
        if args.max_upload_mb <= 0:
            raise SystemExit("--max-upload-mb must be > 0")
        if args.max_request_outputs < 1:
            raise SystemExit("--max-request-outputs must be >= 1")
        for flag in ("max_request_body_mb", "max_inference_steps", "max_num_frames", "max_output_pixels",
                     "max_input_image_pixels"):
            if getattr(args, flag) <= 0:
                raise SystemExit(f"--{flag.replace('_', '-')} must be > 0")

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> FlexibleArgumentParser:
        serve_parser = subparsers.add_parser(
            self.name,
            help=SERVE_HELP,
            description=DESCRIPTION,
            usage="vllm serve MODEL --omni [options]",
        )
        return make_omni_arg_parser(serve_parser)
