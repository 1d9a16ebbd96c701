"""The `vllm-omni` CLI; vLLM's own `vllm` CLI hands every invocation containing `--omni` to `main()`.

So `vllm serve MODEL --omni`, `vllm --omni --help` and `vllm-omni serve MODEL` all reach this parser.
Subcommand modules load lazily so `--help` and `import vllm_omni` stay fast.
"""

from __future__ import annotations

import sys


def _strip_global_omni(argv: list[str]) -> list[str]:
    """`vllm --omni serve M` and `vllm serve M --omni` mean the same; the subcommand keeps its own flag."""
    if argv and argv[0] == "--omni":
        return argv[1:]
    return argv


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_omni import __version__
    from vllm_omni.entrypoints.cli.serve import OmniServeCommand

    argv = _strip_global_omni(list(sys.argv[1:] if argv is None else argv))
    cli_env_setup()
    parser = FlexibleArgumentParser(
        prog="vllm-omni",
        description="vLLM-Omni CLI: serve omni-modality pipelines (AR, generation and diffusion stages) "
        "behind an OpenAI-compatible API. Reached as `vllm-omni <cmd>` or `vllm <cmd> ... --omni`.",
    )
    parser.add_argument("-v", "--version", action="version", version=f"vllm-omni {__version__}")
    parser.add_argument("--omni", action="store_true", help="Accepted for `vllm --omni ...`; implied here.")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    commands = {cmd.name: cmd for cmd in (OmniServeCommand(),)}
    for cmd in commands.values():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(argv)
    if args.subparser in commands:
        commands[args.subparser].validate(args)
    if hasattr(args, "dispatch_function"):
        args.dispatch_function(args)
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
