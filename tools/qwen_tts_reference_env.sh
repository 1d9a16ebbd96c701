#!/usr/bin/env bash
# The reference environment for Qwen3-TTS parity tests: the `qwen-tts` package's modeling code needs
# transformers 4.57 (its pin), which conflicts with the project's transformers. This builds a separate virtualenv
# (cached; default /tmp/vllm-omni-qwen-tts-ref) whose own site-packages hold qwen-tts and its transformers pins,
# installed --no-deps, and which sees the project's .venv (torch, numpy, safetensors, numba, ...) behind them
# through a .pth file. Nothing is installed into .venv. torchaudio (a CUDA build on PyPI) is only imported by the
# 25 Hz tokenizer's speech_vq.py, which the 12 Hz checkpoints never run: the environment gets a placeholder
# `torchaudio` whose every use raises. Prints the reference interpreter's path.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN_TTS_REF_VENV:-/tmp/vllm-omni-qwen-tts-ref}"
STAMP="$VENV/.qwen-tts-ref-3"
if [[ ! -f "$STAMP" ]]; then
  rm -rf "$VENV"
  BASE="$("$ROOT/.venv/bin/python" -c 'import sys; print(sys._base_executable)')"
  "$BASE" -m venv "$VENV" >&2
  "$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_vllm_omni_venv.pth"
  # --ignore-installed: the project's copies seen through the .pth stay untouched.
  "$VENV/bin/pip" install -q --no-deps --ignore-installed \
    qwen-tts==0.1.1 transformers==4.57.3 huggingface_hub==0.36.0 tokenizers==0.22.1 \
    librosa==0.11.0 lazy_loader==0.4 scipy==1.15.3 scikit-learn==1.6.1 joblib==1.5.1 threadpoolctl==3.6.0 \
    soxr==0.5.0.post1 audioread==3.0.1 pooch==1.8.2 decorator==5.2.1 soundfile==0.13.1 sox==1.5.0 \
    onnxruntime==1.22.0 >&2
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$SITE/torchaudio/compliance"
  cat > "$SITE/torchaudio/__init__.py" <<'PY'
"""Placeholder (tools/qwen_tts_reference_env.sh): only qwen-tts's 25 Hz tokenizer uses torchaudio."""
PY
  cat > "$SITE/torchaudio/compliance/__init__.py" < "$SITE/torchaudio/__init__.py"
  cat > "$SITE/torchaudio/compliance/kaldi.py" <<'PY'
"""Placeholder (tools/qwen_tts_reference_env.sh): only qwen-tts's 25 Hz tokenizer uses torchaudio."""


def __getattr__(name):
    raise RuntimeError(f"torchaudio.compliance.kaldi.{name}: torchaudio is not installed in the reference env")
PY
  touch "$STAMP"
fi
echo "$VENV/bin/python"
