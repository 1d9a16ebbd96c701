"""docs/adding_a_model.md is followed literally: its code blocks become a package, and its run script serves the
toy family through `Omni` (real engine, real worker process).

What it pins: a family outside the tree needs only a spec, a pipeline on the skeleton's hooks, a tiny builder and
(for `quality=high/fast`) its cache presets;
`register_family` makes `tiny/<name>` and its `_class_name` resolve; the page cannot drift from the code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_a_model.md"


def _doc_files() -> dict[str, str]:
    blocks = re.findall(r"```python\n# file: (\S+)\n(.*?)```", DOC.read_text(), flags=re.S)
    return {name: body for name, body in blocks}


def test_walkthrough_runs_as_written(tmp_path):
    files = _doc_files()
    assert {"toy_family/spec.py", "toy_family/cache.py", "toy_family/tiny.py", "toy_family/pipeline.py",
            "run_toy.py"} <= set(files)
    for name, body in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    (tmp_path / "toy_family" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "VLLM_OMNI_TINY_CACHE": str(tmp_path / "tiny-cache")}
    proc = subprocess.run([sys.executable, "run_toy.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("(16, 16)"), proc.stdout
    assert "diffusion" in last and "diffusion.denoise" in last, last
    assert last.endswith("reused steps: 1"), last  # quality=high from the presets in its folder: 4 steps, 1 reused
