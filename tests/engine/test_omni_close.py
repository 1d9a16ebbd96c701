"""`Omni.close()` on an AR stage shuts vLLM's AsyncLLM down and drops it, so nothing is left for interpreter exit:
an AsyncLLM still referenced then runs `__del__` -> `shutdown()` after module globals are cleared and prints
"Exception ignored in AsyncLLM.__del__ ... TypeError". A tiny Qwen2 `Omni` in a fresh interpreter, real EngineCore."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
from vllm import SamplingParams
from vllm_omni import Omni

if __name__ == "__main__":
    omni = Omni(model="tiny/qwen2", gpu_memory_utilization=0.15, max_model_len=256, enforce_eager=True)
    out = omni.generate(["hello"], SamplingParams(max_tokens=4))
    assert out and out[0].final_output_type == "text", out
    omni.close()
    print("closed", flush=True)
"""


def test_close_leaves_nothing_for_interpreter_exit(tmp_path):
    script = tmp_path / "close.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    assert "closed" in out.stdout
    assert "Exception ignored" not in out.stderr and "Exception ignored" not in out.stdout, out.stderr[-4000:]
