#!/usr/bin/env bash
# The README's test command: set up .venv (idempotent), lint, then run the CPU test suite.
#   bash tools/test.sh [extra pytest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash tools/setup_env.sh
py=.venv/bin/python
echo "[test] ruff check"
"$py" -m ruff check vllm_omni tests benchmarks examples tools
# Two pytest workers (pytest-xdist): a test spends much of its time waiting on its servers' and engines' processes,
# so two units side by side keep the 2-core machine busy. tests/conftest.py's WORKER_UNITS keep the tests that share
# an engine or server on one worker, so each starts once. VLLM_OMNI_TEST_WORKERS=0: one pytest process.
workers=${VLLM_OMNI_TEST_WORKERS:-2}
xdist=()
[ "$workers" -gt 0 ] && xdist=(-n "$workers" --dist loadscope)
echo "[test] pytest ${xdist[*]}"
set +e
"$py" -m pytest "${xdist[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] no tests were collected"; exit 1
fi
exit "$rc"
