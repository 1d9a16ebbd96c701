"""A hub id without the hub: offline (HF_HUB_OFFLINE) or with the hub unreachable, a model that is not in the
local cache fails within seconds with one line saying so and how to pass a local path (huggingface_hub alone
retries ~25 s per file and then reports a missing model_index.json/config.json); a cached one still resolves;
a local directory without a recognisable layout names the files it lacks. Unreachable is a closed local port
as HF_ENDPOINT, so the result is the same with or without network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.entrypoints.openai.live_server import free_port
from vllm_omni.config.omni_config import pipeline_for_model
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.errors import OmniClientError

MISSING = "no-such-org/no-such-model"
FAST_S = 10.0


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, where huggingface_hub reads the HF_* variables at import."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


RESOLVE = """
import time
from vllm_omni.config.omni_config import pipeline_for_model
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.errors import OmniClientError
t = time.monotonic()
try:
    print(pipeline_for_model({model!r}).stages[0].execution_type)
except OmniClientError as exc:
    print("param", exc.param)
    print("error", exc)
print("elapsed", time.monotonic() - t)
"""


def _fake_cache(root, repo: str, files: dict[str, dict]) -> None:
    """A Hugging Face cache holding `files` of `repo` at main, in the layout huggingface_hub writes."""
    commit = "0" * 40
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, content in files.items():
        (snapshot / name).write_text(json.dumps(content))


def test_offline_hub_id_fails_fast_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(OmniClientError) as info:
        pipeline_for_model(MISSING)
    assert time.monotonic() - start < FAST_S
    message = str(info.value)
    assert info.value.param == "model" and "\n" not in message
    assert "nor in the Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message
    assert "pass a local path" in message and f"hf download {MISSING}" in message


def test_unreachable_hub_fails_fast():
    out = _run(RESOLVE.format(model=MISSING), HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["param"] == "model"
    assert "nor in the Hugging Face cache, and the hub cannot be reached" in lines["error"]
    assert "pass a local path" in lines["error"]
    assert float(lines["elapsed"]) < FAST_S


@pytest.mark.parametrize("offline", ["1", "0"])
def test_cached_hub_id_resolves_without_the_hub(tmp_path, offline):
    _fake_cache(tmp_path, "org/cached-pipe", {"model_index.json": {"_class_name": "QwenImagePipeline"}})
    out = _run(RESOLVE.format(model="org/cached-pipe"), HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE=offline,
               HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[0] == str(StageKind.DIFFUSION)


def test_local_dir_without_layout_names_what_is_missing(tmp_path):
    with pytest.raises(OmniClientError, match="neither model_index.json .* nor config.json") as info:
        pipeline_for_model(str(tmp_path))
    assert info.value.param == "model"
    with pytest.raises(OmniClientError, match="is not a directory"):
        pipeline_for_model(str(tmp_path / "missing"))


def test_serve_offline_hub_id_is_one_line_no_traceback(tmp_path):
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    out = subprocess.run([vllm, "serve", MISSING, "--omni", "--port", str(free_port())], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"vllm-omni serve: model '{MISSING}' is neither a local directory nor in the Hugging")
