"""INFO lines of diffusion worker processes reach the server's log, prefixed with their stage and rank, at the
server's log level (issue 12).

Before, the `vllm_omni` loggers in a spawned worker had no handler and vLLM's logging was never configured
there, so everything below WARNING vanished."""

from __future__ import annotations

import re

import pytest
from fake_pipelines import FakeBatchPipeline, class_path
from vllm.config.logging import LoggingConfig

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

LOADED = re.compile(r"\(DiffusionWorker_S3_R0 pid=\d+\) INFO .*loaded .* as FakeBatchPipeline")


@pytest.mark.parametrize("level", [None, "WARNING"])
def test_worker_info_line_reaches_the_log_with_stage_and_rank(tmp_path, capfd, level):
    logging_config = None if level is None else LoggingConfig(log_level=level)
    config = OmniDiffusionConfig(model=str(tmp_path), model_class_name=class_path(FakeBatchPipeline), stage_id=3,
                                 logging_config=logging_config)
    engine = DiffusionEngine(config)
    engine.close()
    out = capfd.readouterr()
    # The workers write to the file descriptors they inherit, so the fd-level capture sees their lines.
    lines = (out.out + out.err).splitlines()
    seen = any(LOADED.search(line) for line in lines)
    assert seen == (level is None), "\n".join(lines)
