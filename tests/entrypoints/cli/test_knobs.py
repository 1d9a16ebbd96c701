"""Knobs tell the truth: docs/cli.md is the parser's own text, and knobs of unbuilt features are refused at
start-up naming the flag (issue 12), before any engine or worker process starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from vllm_omni.config.omni_config import StageConfigFactory
from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.engine.arg_utils import OmniEngineArgs
from vllm_omni.entrypoints.cli import docs
from vllm_omni.errors import OmniClientError

ROOT = Path(__file__).parents[3]
PAGE = ROOT / docs.CLI_PAGE
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def parser():
    return docs.serve_parser()


def test_cli_page_flag_tables_match_the_parser(parser):
    text = PAGE.read_text()
    assert text == docs.update(text, docs.cli_tables(parser)), "regenerate: python -m vllm_omni.entrypoints.cli.docs"


def test_diffusion_config_table_matches_the_dataclasses():
    text = (ROOT / docs.CONFIG_PAGE).read_text()
    assert text == docs.update(text, docs.config_table()), "regenerate: python -m vllm_omni.entrypoints.cli.docs"


def test_every_flag_the_page_names_exists(parser):
    options = {opt for action in parser._actions for opt in action.option_strings}
    named = set(re.findall(r"(--(?:\[no-\])?[a-z][a-z0-9-]*[a-z0-9])(?![a-z0-9*=-])", PAGE.read_text()))
    missing = {flag for flag in named if flag.replace("[no-]", "") not in options}
    assert not missing, f"docs/cli.md names flags the parser lacks: {sorted(missing)}"


def test_every_omni_flag_has_help_from_a_docstring(parser):
    groups = [g for g in parser._action_groups if g.title in docs.GROUPS]
    assert [g.title for g in groups] == list(docs.GROUPS)
    assert all(a.help for g in groups for a in g._group_actions)


def run_with_cpu_time(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd`; its own CPU seconds from `wait4` (`RUSAGE_CHILDREN` also counted an earlier test's child that
    `subprocess` reaped meanwhile: 16.7 s of CPU in 8.4 s wall on 2 cores)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(cmd, proc.returncode, out.read().decode(), err.read().decode())
    return result, usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize(("flags", "named"), [
    (["--cache-backend", "tea_cache", "--cache-config", '{"bogus": 1}'], "--cache-config"),
    (["--num-gpus", "2"], "--num-gpus"),
    (["--diffusion-attention-backend", "SAGE_ATTN"], "--diffusion-attention-backend"),
])
def test_vllm_serve_refuses_unimplemented_knobs_at_startup(flags, named):
    """`vllm serve ... --omni` exits non-zero naming the flag, having started nothing (no worker, no engine).

    The bound is on the command's own CPU time, which is what it costs on an idle machine (about 4.5 s, nearly
    all of it `vllm`'s own start-up imports); wall time on a shared test box also counts other people's load
    and is only reported."""
    start = time.perf_counter()
    out, cpu = run_with_cpu_time([str(BIN / "vllm"), "serve", "tiny/qwen-image", "--omni", *flags], timeout=120)
    wall = time.perf_counter() - start
    assert out.returncode != 0
    assert named in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "Starting" not in out.stderr + out.stdout
    assert cpu < 10.0, f"refusal took {cpu:.1f} s of CPU ({wall:.1f} s wall)"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"ulysses_degree": 0}, "ulysses_degree"),
    ({"ring_degree": -1}, "ring_degree"),
    ({"cfg_parallel_size": 3}, "cfg_parallel_size"),
    ({"sequence_parallel_size": 3, "ulysses_degree": 2}, "sequence_parallel_size"),
    ({"num_gpus": 2}, "num_gpus"),
    ({"diffusion_attention_backend": "SAGE_ATTN"}, "diffusion_attention_backend"),
    ({"stage_overrides": {"0": {"ulysses_degree": 0}}}, "ulysses_degree"),
    ({"parallel_config": {"ring_degree": 0}}, "ring_degree"),
])
def test_resolution_refuses_unimplemented_knobs(kwargs, param):
    with pytest.raises(OmniClientError) as info:
        StageConfigFactory.create_from_model("tiny/qwen-image", **kwargs)
    assert info.value.param == param
    assert param in info.value.message and "--" + param.replace("_", "-") in info.value.message


def test_omni_refuses_a_bad_parallel_degree_before_starting_workers():
    from vllm_omni import Omni

    start = time.perf_counter()
    with pytest.raises(OmniClientError, match="cfg_parallel_size") as info:
        Omni(model="tiny/qwen-image", cfg_parallel_size=3)
    assert info.value.param == "cfg_parallel_size"
    assert time.perf_counter() - start < 10.0


def test_vllm_serve_refuses_exactly_the_omni_flags_of_unbuilt_features():
    from vllm_omni.diffusion.data import NOT_IMPLEMENTED
    from vllm_omni.engine.arg_utils import OMNI_ARG_NAMES

    assert set(NOT_IMPLEMENTED) <= OMNI_ARG_NAMES


@pytest.mark.parametrize(("flags", "read"), [
    (["--ring-degree", "1"], lambda od: od.parallel_config.ring_degree),
    (["--cache-backend", "none"], lambda od: od.cache_backend),
    (["--num-gpus", "1"], lambda od: od.num_gpus),
])
def test_off_values_are_not_refused(parser, flags, read):
    """The "off" value of a refused feature passes validation and reaches the stage's diffusion config."""
    from vllm_omni.entrypoints.cli.serve import OmniServeCommand

    args = parser.parse_args(["tiny/qwen-image", "--omni", *flags])
    OmniServeCommand().validate(args)
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))
    assert kwargs  # the flag was set, so it is passed on
    (stage,) = StageConfigFactory.create_from_model("tiny/qwen-image", **kwargs).stages
    assert str(read(stage.make_od_config())) == flags[1]


def test_configs_refuse_unimplemented_values_and_keep_the_implemented_ones():
    with pytest.raises(OmniClientError, match="cfg_parallel_size"):
        DiffusionParallelConfig(cfg_parallel_size=3)
    with pytest.raises(OmniClientError, match="cache_backend"):
        OmniDiffusionConfig(model="m", cache_backend="cache_dit", step_execution=True)
    assert OmniDiffusionConfig(model="m", cache_backend="none", num_gpus=1).parallel_config.world_size == 1
    od = StageConfigFactory.create_from_model("tiny/qwen-image", tensor_parallel_size=2).stages[0].make_od_config()
    assert od.parallel_config.tensor_parallel_size == od.parallel_config.world_size == 2


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--diffusion-attention-backend", "TORCH_SDPA"], "diffusion_attention_backend", "TORCH_SDPA"),
    (["--request-batch-max-wait-ms", "25"], "request_batch_max_wait_ms", 25.0),
    (["--fa-deterministic"], "fa_deterministic", True),
    (["--use-diffusers-adapter"], "use_diffusers_adapter", True),
    (["--diffusers-load-kwargs", '{"low_cpu_mem_usage": false}'], "diffusers_load_kwargs",
     {"low_cpu_mem_usage": False}),
])
def test_diffusion_flags_reach_the_diffusion_config(parser, flags, field, value):
    args = parser.parse_args(["tiny/qwen-image", "--omni", *flags])
    kwargs = OmniEngineArgs.omni_kwargs_from_cli(args, parser.parse_args([]))
    (stage,) = StageConfigFactory.create_from_model("tiny/qwen-image", **kwargs).stages
    assert getattr(stage.make_od_config(), field) == value
