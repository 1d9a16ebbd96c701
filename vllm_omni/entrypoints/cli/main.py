"""The `vllm-omni` CLI; vLLM's own `vllm` CLI hands every invocation containing `--omni` to `main()`.

So `vllm serve MODEL --omni`, `vllm --omni --help` and `vllm-omni serve MODEL` all reach this parser.
Subcommand modules load lazily so `--help` and `import vllm_omni` stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from vllm_omni import __version__
from vllm_omni.errors import OmniClientError

if TYPE_CHECKING:
    from vllm_omni.diffusion.core.prestart import PrestartedCore

SERVE_HELP = "Launch the vllm-omni OpenAI-compatible server."


def _strip_global_omni(argv: list[str]) -> list[str]:
    """`vllm --omni serve M` and `vllm serve M --omni` mean the same; the subcommand keeps its own flag."""
    if argv and argv[0] == "--omni":
        return argv[1:]
    return argv


def _refuse_unimplemented(argv: list[str]) -> None:
    """Knobs of unbuilt features (and an attention backend that does not exist) fail before vLLM's serve parser
    and its imports run (seconds of CPU).

    A fast path only: `OmniServeCommand.validate` checks the fully parsed flags again (e.g. the
    `--cache-config.key value` form), and a malformed value is left to the serve parser to name."""
    from vllm_omni.diffusion.data import (
        NOT_IMPLEMENTED,
        check_attention_backend,
        check_cache_args,
        refuse_unimplemented,
    )

    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    early.add_argument("--diffusion-attention-backend")
    early.add_argument("--cache-backend")
    early.add_argument("--cache-config", type=json.loads)
    early.add_argument("--step-execution", action="store_true")
    for name in sorted(NOT_IMPLEMENTED):
        off = NOT_IMPLEMENTED[name][1][0]
        early.add_argument("--" + name.replace("_", "-"), type=json.loads if isinstance(off, dict) else type(off))
    try:
        known, _ = early.parse_known_args(argv)
    except argparse.ArgumentError:
        return
    try:
        values = vars(known)
        check_attention_backend(values.pop("diffusion_attention_backend"))
        check_cache_args({k: values.pop(k) for k in ("cache_backend", "cache_config", "step_execution")})
        refuse_unimplemented(values)
    except OmniClientError as exc:
        raise SystemExit(f"vllm-omni serve: {exc.message}") from None


def _prestart_diffusion_core(argv: list[str]) -> PrestartedCore | None:
    """For a diffusers checkpoint on disk (a local path or a built `tiny/` name with a model_index.json, served
    without a pipeline YAML), fork its diffusion core now, while this process still runs one thread and before
    the serve parser's and the server's imports (`diffusion/core/prestart.py`); else None."""
    from pathlib import Path

    from vllm_omni.catalog.tiny import TINY_PREFIX, built_tiny

    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    early.add_argument("model_tag", nargs="?")
    early.add_argument("--model")
    early.add_argument("--pipeline-config")
    early.add_argument("-h", "--help", nargs="?", const="")
    try:
        known, _ = early.parse_known_args(argv)
    except argparse.ArgumentError:
        return None
    model = known.model_tag or known.model
    if model is None or known.pipeline_config is not None or known.help is not None:
        return None
    path = Path(model)
    if model.startswith(TINY_PREFIX) and not path.exists():
        try:
            path = built_tiny(model)
        except KeyError:  # not a tiny name: the serve command names the error
            return None
    if path is None or not (path / "model_index.json").is_file():
        return None
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use CUDA
        return None
    from vllm_omni.catalog.registry import MODEL_REGISTRY
    from vllm_omni.diffusion.core.prestart import PrestartedCore

    class_name = json.loads((path / "model_index.json").read_text()).get("_class_name")
    pipeline = MODEL_REGISTRY.pipeline_class_path(class_name) if isinstance(class_name, str) else None
    return PrestartedCore(preload=(pipeline.split(":")[0],) if pipeline else ())


def main(argv: list[str] | None = None) -> None:
    argv = _strip_global_omni(list(sys.argv[1:] if argv is None else argv))
    parser_cls = argparse.ArgumentParser
    prestarted_core = None
    if argv[:1] == ["serve"]:
        _refuse_unimplemented(argv[1:])
        prestarted_core = _prestart_diffusion_core(argv[1:])
        # vLLM's parser: `--help=<group>`, `--help=all`, `--help=<flag>`, `--config`
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
        # No vLLM `cli_env_setup()`: its `VLLM_WORKER_MULTIPROC_METHOD=spawn` would look like the user's choice, and
        # every EngineCore would then spawn its worker too (a fresh torch + vLLM import per AR stage). The engine
        # spawns its stage processes itself and lets each EngineCore fork its worker (AsyncOmniEngine, plugins.py).
        from vllm_omni.entrypoints.cli.serve import OmniServeCommand

        command = OmniServeCommand()
        command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    else:  # help/version only: skip building the (heavy) engine-args parser
        subparsers.add_parser("serve", help=SERVE_HELP)
    try:
        args = parser.parse_args(argv)
        if hasattr(args, "dispatch_function"):
            command.validate(args)
            try:
                args.dispatch_function(args, prestarted_core)
            except OmniClientError as exc:  # a model or flag the server cannot start with: one line, no traceback
                raise SystemExit(f"vllm-omni {args.subparser}: {exc}") from None
        else:
            parser.print_help()
    finally:
        if prestarted_core is not None:
            prestarted_core.close()

if __name__ == "__main__":
    main()
