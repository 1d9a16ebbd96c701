"""The `vllm-omni` CLI; vLLM's own `vllm` CLI hands every invocation containing `--omni` to `main()`.

So `vllm serve MODEL --omni`, `vllm --omni --help` and `vllm-omni serve MODEL` all reach this parser.
Subcommand modules load lazily so `--help` and `import vllm_omni` stay fast.
"""

from __future__ import annotations

import argparse
import sys

from vllm_omni import __version__
from vllm_omni.errors import OmniClientError

SERVE_HELP = "Launch the vllm-omni OpenAI-compatible server."


def _strip_global_omni(argv: list[str]) -> list[str]:
    """`vllm --omni serve M` and `vllm serve M --omni` mean the same; the subcommand keeps its own flag."""
    if argv and argv[0] == "--omni":
        return argv[1:]
    return argv


def main(argv: list[str] | None = None) -> None:
    argv = _strip_global_omni(list(sys.argv[1:] if argv is None else argv))
    parser_cls = argparse.ArgumentParser
    if argv[:1] == ["serve"]:  # vLLM's parser: `--help=<group>`, `--help=all`, `--help=<flag>`, `--config`
        from vllm.utils.argparse_utils import FlexibleArgumentParser as parser_cls
    parser = parser_cls(
        prog="vllm-omni",
        description="vLLM-Omni CLI: serve omni-modality pipelines (AR, generation and diffusion stages) "
        "behind an OpenAI-compatible API. Reached as `vllm-omni <cmd>` or `vllm <cmd> ... --omni`.",
    )
    parser.add_argument("-v", "--version", action="version", version=f"vllm-omni {__version__}")
    parser.add_argument("--omni", action="store_true", help="Accepted for `vllm --omni ...`; implied here.")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    if argv[:1] == ["serve"]:
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

        from vllm_omni.entrypoints.cli.serve import OmniServeCommand

        cli_env_setup()
        command = OmniServeCommand()
        command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    else:  # help/version only: skip building the (heavy) engine-args parser
        subparsers.add_parser("serve", help=SERVE_HELP)
    args = parser.parse_args(argv)
    if hasattr(args, "dispatch_function"):
        command.validate(args)
        try:
            args.dispatch_function(args)
        except OmniClientError as exc:  # a model or flag the server cannot start with: one line, no traceback
            raise SystemExit(f"vllm-omni {args.subparser}: {exc}") from None
    else:
        parser.print_help()

if __name__ == "__main__":
    main()
