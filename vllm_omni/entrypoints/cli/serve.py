"""`vllm serve MODEL --omni`: start the OpenAI-compatible vllm-omni server on an `AsyncOmni` engine."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from dataclasses import dataclass, fields

from vllm.entrypoints.cli.types import CLISubcommand
from vllm.entrypoints.launchers.cli_args import FrontendArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_omni.diffusion.core.prestart import PrestartedCore
from vllm_omni.diffusion.data import NOT_IMPLEMENTED, check_cache_args, refuse_unimplemented
from vllm_omni.engine.arg_utils import OmniEngineArgs, add_dataclass_args, attr_help
from vllm_omni.entrypoints.cli.main import SERVE_HELP
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import DiffusionLimits

DESCRIPTION = """Launch the vllm-omni OpenAI-compatible server for MODEL (a Hugging Face id, a local path,
or a built-in tiny default such as tiny/qwen-image or tiny/qwen2).

Routes: /v1/chat/completions (+ /batch), /v1/images/generations, /v1/images/edits, /v1/audio/speech,
/v1/videos, /v1/models, /health, /ping, /version, /metrics, /v1/omni/sleep, /v1/omni/wakeup; a pipeline whose
first stage is an AR model also gets vLLM's own routes (/v1/completions, /v1/responses, /tokenize,
/detokenize, ...).
`--pipeline-config FILE.yaml` serves a multi-stage YAML pipeline instead of MODEL's own topology.
Use `--help=<group>` (e.g. --help=OmniConfig, --help=Frontend) or `--help=all` for every flag.
"""


@dataclass
class OmniFrontendArgs:
    """HTTP-server limits of vllm-omni on top of vLLM's frontend flags."""

    max_upload_mb: float = 20.0
    """Largest accepted upload (image edits, input images) in MiB; larger ones get 413."""
    max_request_outputs: int = 8
    """Most images/videos one request may ask for (`n`, `num_outputs_per_prompt`)."""
    max_request_body_mb: float = 32.0
    """Largest accepted request body in MiB (multipart uploads: `--max-upload-mb` + 1); larger ones get 413
    before they are read."""
    max_inference_steps: int = DiffusionLimits.max_inference_steps
    """Most denoise steps (`num_inference_steps`) one diffusion request may ask for."""
    max_num_frames: int = DiffusionLimits.max_num_frames
    """Most video frames (`num_frames`, or seconds x fps) one request may ask for."""
    max_output_pixels: int = DiffusionLimits.max_output_pixels
    """Most output pixels (width x height) per image or video frame."""
    max_input_image_pixels: int = 4096 * 4096
    """Most pixels of an input image, read from its header before it is decoded; also bounds each frame of an
    input video."""
    max_input_audio_seconds: float = 600.0
    """Longest input audio (chat `input_audio` / `audio_url` parts, a video's audio track) in seconds, after
    decoding; vLLM's VLLM_MAX_AUDIO_DECODE_DURATION_S bounds the decoding itself."""
    max_input_video_frames: int = 256
    """Most frames of one input video after vLLM's loader sampled them (`--media-io-kwargs
    '{"video": {"num_frames": N}}'` sets how many it samples)."""
    disable_playground: bool = False
    """Do not serve the browser playground page at /playground."""
    strict_request_fields: bool = False
    """Refuse (400, naming them) request fields a vllm-omni route does not know. Off: they are ignored with a
    warning, as vLLM does (the OpenAI SDK and frameworks send fields such as `store` and `metadata`). vLLM's own
    routes (/v1/completions, /v1/responses, ...) keep vLLM's policy either way."""


def add_omni_frontend_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="OmniFrontend", description="vllm-omni HTTP server options.")
    names = [f.name for f in fields(OmniFrontendArgs)]
    add_dataclass_args(group, OmniFrontendArgs, names, attr_help(OmniFrontendArgs))
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
    def cmd(args: argparse.Namespace, prestarted_core: PrestartedCore | None = None) -> None:
        import uvloop
        from vllm.logger import configure_logging_from_args

        from vllm_omni.entrypoints.openai.api_server import run_server

        if args.model_tag is not None:
            args.model = args.model_tag
        # vLLM's `vllm` hands `--omni` over before it configures logging; its args.logging_config then
        # travels to every stage, so EngineCores and diffusion workers log at the server's level.
        configure_logging_from_args(args)
        uvloop.run(run_server(args, prestarted_core=prestarted_core))
        _exit_without_teardown()

    def validate(self, args: argparse.Namespace) -> None:
        if args.model_tag is None and getattr(args, "model", None) is None:
            raise SystemExit("vllm-omni serve: a MODEL is required (e.g. `vllm serve tiny/qwen-image --omni`)")
        if args.max_upload_mb <= 0:
            raise SystemExit("--max-upload-mb must be > 0")
        if args.max_request_outputs < 1:
            raise SystemExit("--max-request-outputs must be >= 1")
        for flag in ("max_request_body_mb", "max_inference_steps", "max_num_frames", "max_output_pixels",
                     "max_input_image_pixels", "max_input_audio_seconds", "max_input_video_frames"):
            if getattr(args, flag) <= 0:
                raise SystemExit(f"--{flag.replace('_', '-')} must be > 0")
        try:  # here, before any engine or worker starts
            refuse_unimplemented({name: getattr(args, name) for name in NOT_IMPLEMENTED})
            check_cache_args({k: getattr(args, k) for k in ("cache_backend", "cache_config", "step_execution")})
        except OmniClientError as exc:
            raise SystemExit(f"vllm-omni serve: {exc.message}") from None

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> FlexibleArgumentParser:
        serve_parser = subparsers.add_parser(
            self.name,
            help=SERVE_HELP,
            description=DESCRIPTION,
            usage="vllm serve MODEL --omni [options]",
        )
        return make_omni_arg_parser(serve_parser)


def _exit_without_teardown() -> None:
    """The server has stopped and released everything it started (`run_server` closed the engine, its stage
    processes and the socket): run the exit handlers (logging, multiprocessing's finalizers), then leave without
    the interpreter's teardown, a garbage collection over every torch and vLLM object that freed nothing the
    process exit does not (4 s of an idle tiny Qwen-Image server's SIGTERM to exit at load 7, 16 s for tiny Qwen2
    at load 25; with this 1.0 s at load 20). The diffusion workers leave the same way (worker_proc.py)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

