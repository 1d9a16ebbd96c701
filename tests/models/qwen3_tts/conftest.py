"""Shared fixtures: the tiny checkpoint, and the `qwen-tts` package's reference outputs on it, made by
reference.py in the separate virtualenv tools/qwen_tts_reference_env.sh builds (cached in /tmp: the package pins
transformers 4.57, which the project's environment does not have)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.models.qwen3_omni.pipeline import CODE2WAV_CHUNK_SCHEDULE

ROOT = Path(__file__).resolve().parents[3]
FRAMES = 24
REQUESTS = [
    {"text": "Hello! How are you today?", "speaker": "vivian", "language": "auto", "max_new_tokens": FRAMES},
    # a dialect speaker (its dialect's language id) with a style instruction (a user turn before the text)
    {"text": "The quick brown fox jumps over the lazy dog.", "speaker": "dylan", "language": "chinese",
     "instruct": "Speak slowly and warmly.", "max_new_tokens": FRAMES},
    {"text": "One two three four five.", "speaker": "ryan", "language": "english", "max_new_tokens": FRAMES},
]


@pytest.fixture(scope="package")
def tiny_path() -> Path:
    return build_tiny("qwen3-tts")


@pytest.fixture(scope="package")
def reference(tiny_path) -> list[dict]:
    """Per request of REQUESTS: the reference's greedy codec frames, its waveform (`speech_tokenizer.decode`)
    and its decoder run on the pipeline's chunk schedule. Cached beside the reference env, keyed by the
    checkpoint (its directory name is its builder's hash), reference.py and the requests."""
    python = subprocess.run(["bash", str(ROOT / "tools/qwen_tts_reference_env.sh")], check=True, text=True,
                            capture_output=True, timeout=900).stdout.strip()
    script = Path(__file__).with_name("reference.py")
    schedule = json.dumps(list(CODE2WAV_CHUNK_SCHEDULE))
    key = hashlib.sha256(json.dumps([tiny_path.name, script.read_text(), REQUESTS, schedule]).encode()).hexdigest()
    out = Path(python).parents[1] / "outputs" / key[:16]
    if not (out / "codes.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        (out / "requests.json").write_text(json.dumps(REQUESTS))
        subprocess.run([python, str(script), str(tiny_path), str(out / "requests.json"), str(out), schedule],
                       check=True, capture_output=True, timeout=600)
    codes = json.loads((out / "codes.json").read_text())
    return [{"frames": codes[i], "wav": np.load(out / f"wav_{i}.npy"), "chunked": np.load(out / f"chunked_{i}.npy")}
            for i in range(len(REQUESTS))]


def omni_prompt(request: dict) -> dict:
    prompt = {"prompt": request["text"], "voice": request["speaker"], "language": request["language"]}
    if request.get("instruct"):
        prompt["instructions"] = request["instruct"]
    return prompt
