#!/usr/bin/env bash
# Every `cuda`-marked test, on a machine with a CUDA GPU (CPU CI skips them: tests/conftest.py).
#
#   bash tools/gpu_test.sh [PYTEST ARGS...]             # e.g. -x, -k qwen_image
#   source .gpu/bootstrap.sh && bash tools/gpu_test.sh  # on the device machine (carry [".gpu"])
#
# Collects only the test modules that hold a `cuda` mark (the browser modules need selenium, which the GPU image
# lacks, and hold none) and runs them with `-m cuda`. tests/diffusion/distributed/test_cuda_parallel_world1.py
# owns its process's distributed world, so it runs in a pytest process of its own. Exit status: the first
# failing pytest's (5, nothing collected, counts as a failure).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ALONE=tests/diffusion/distributed/test_cuda_parallel_world1.py
"$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'tools/gpu_test.sh: no CUDA GPU here')" \
  || exit 1
mapfile -t modules < <(grep -rlE 'pytest\.mark\.cuda' tests --include='test_*.py' | grep -vxF "$ALONE" | sort)
echo "[gpu_test] ${#modules[@]} modules + $ALONE"
rc=0
"$PYTHON" -m pytest -m cuda -p no:cacheprovider "${modules[@]}" "$@" || rc=$?
"$PYTHON" -m pytest -m cuda -p no:cacheprovider "$ALONE" "$@" || { r=$?; [ "$rc" -ne 0 ] || rc=$r; }
echo "[gpu_test] exit $rc"
exit "$rc"
