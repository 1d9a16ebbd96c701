"""INFO lines of diffusion worker processes reach the server's log, prefixed with their stage and rank (issue 12).

Before, the `vllm_omni` loggers in a spawned worker had no handler and vLLM's logging was never configured
there, so everything below WARNING vanished."""

from __future__ import annotations

import re

from fake_pipelines import FakeBatchPipeline, class_path

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine


def test_worker_info_line_reaches_the_log_with_stage_and_rank(tmp_path, capfd):
    config = OmniDiffusionConfig(model=str(tmp_path), model_class_name=class_path(FakeBatchPipeline), stage_id=3)
    engine = DiffusionEngine(config)
    engine.close()
    out = capfd.readouterr()
    # The workers write to the file descriptors they inherit, so the fd-level capture sees their lines.
    lines = (out.out + out.err).splitlines()
    assert any(re.search(r"\(DiffusionWorker_S3_R0 pid=\d+\) INFO .*loaded .* as FakeBatchPipeline", line)
               for line in lines), "\n".join(lines)
