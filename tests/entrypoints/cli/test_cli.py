"""The CLI is reachable the three ways users type it and passes on only the engine flags they set.

Pins: vLLM's own `vllm` hands `--omni` invocations to our parser (issue #2), `vllm-omni` is the same
parser, and `import vllm_omni` stays light (< 2 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_omni.engine.arg_utils import OmniEngineArgs
from vllm_omni.entrypoints.cli.serve import make_omni_arg_parser

BIN = Path(sys.executable).parent


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_vllm_omni_help_is_ours():
    out = run(str(BIN / "vllm"), "--omni", "--help")
    assert out.returncode == 0, out.stderr
    assert "vLLM-Omni CLI" in out.stdout and "serve" in out.stdout


def test_vllm_omni_console_script():
    out = run(str(BIN / "vllm-omni"), "--version")
    assert out.returncode == 0 and "vllm-omni" in out.stdout


def test_serve_help_lists_omni_flags(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["--help=OmniConfig"])
    out = capsys.readouterr().out
    for flag in ("--stage-overrides", "--diffusion-attention-backend", "--request-batch-max-wait-ms",
                 "--cache-backend", "--cache-config", "--fa-deterministic", "--stage-init-timeout",
                 "--model-class-name"):
        assert flag in out


def test_import_is_light():
    best = min(_timed_import() for _ in range(3))
    assert best < 2.0, f"import vllm_omni took {best:.2f} s"


def _timed_import() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import vllm_omni"], check=True, timeout=60)
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def parser():
    return make_omni_arg_parser(FlexibleArgumentParser())


def test_only_changed_engine_flags_reach_async_omni(parser):
    args = parser.parse_args(["tiny/qwen2", "--omni", "--port", "9000", "--max-num-seqs", "2",
                              "--cache-config", '{"Fn_compute_blocks": 1}', "--diffusion-attention-backend",
                              "TORCH_SDPA", "--stage-overrides", '{"0": {"max_num_seqs": 3}}',
                              "--served-model-name", "my-model"])
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))
    assert kwargs == {"max_num_seqs": 2, "cache_config": {"Fn_compute_blocks": 1},
                      "diffusion_attention_backend": "TORCH_SDPA", "stage_overrides": {"0": {"max_num_seqs": 3}}}


@pytest.mark.parametrize("eager", [True, False])
def test_load_format_and_enforce_eager_reach_the_diffusion_config(parser, eager):
    """vLLM's own --load-format / --[no-]enforce-eager flags land in the diffusion stage's OmniDiffusionConfig
    (the diffusion default is eager, so --no-enforce-eager must travel although it equals vLLM's default)."""
    from vllm_omni.config.omni_config import StageConfigFactory

    flag = "--enforce-eager" if eager else "--no-enforce-eager"
    args = parser.parse_args(["tiny/qwen-image", "--omni", "--load-format", "dummy", flag, "--max-num-seqs", "2"])
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))
    assert kwargs == {"load_format": "dummy", "enforce_eager": eager, "max_num_seqs": 2}
    (stage,) = StageConfigFactory.create_from_model("tiny/qwen-image", **kwargs).stages
    od_config = stage.make_od_config()
    assert (od_config.load_format, od_config.enforce_eager, od_config.max_num_seqs) == ("dummy", eager, 2)
    assert "enforce_eager" not in OmniEngineArgs.omni_kwargs_from_cli(parser.parse_args(["m"]),
                                                                      parser.parse_args([]))


def test_model_class_name_reaches_the_diffusion_config(parser):
    """TI2V-5B image-to-video over HTTP: `--model-class-name WanImageToVideoPipeline`."""
    from vllm_omni.config.omni_config import StageConfigFactory

    args = parser.parse_args(["tiny/wan2.2-ti2v-5b", "--omni", "--model-class-name", "WanImageToVideoPipeline"])
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))
    assert kwargs == {"model_class_name": "WanImageToVideoPipeline"}
    (stage,) = StageConfigFactory.create_from_model("tiny/wan2.2-ti2v-5b", **kwargs).stages
    assert stage.make_od_config().model_class_name == "WanImageToVideoPipeline"


def test_bad_flag_values_name_the_flag(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--stage-overrides", "[1, 2]"])
    assert "--stage-overrides must be a JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--diffusion-attention-backend", "MAGIC"])
    assert "--diffusion-attention-backend" in capsys.readouterr().err


def test_serve_leaves_the_start_method_to_the_engine(monkeypatch, capsys):
    """Why: vLLM's `cli_env_setup` sets `VLLM_WORKER_MULTIPROC_METHOD=spawn`, which then reads as the user's
    choice, and every EngineCore of `vllm serve --omni` spawned its worker (a fresh torch + vLLM import per AR
    stage) instead of forking it (plugins.py)."""
    from vllm_omni.entrypoints.cli.main import main

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--omni" in capsys.readouterr().out
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
