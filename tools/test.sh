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
# Two pytest workers (pytest-xdist) by default: a test spends much of its time waiting on its servers' and engines'
# processes, so two test modules side by side keep the 2-core CI machine busy. tests/conftest.py groups the tests so
# that each engine or server still starts once. VLLM_OMNI_TEST_WORKERS=0: one pytest process.
workers=${VLLM_OMNI_TEST_WORKERS:-2}
xdist=()
[ "$workers" -gt 0 ] && xdist=(-n "$workers" --dist loadgroup)
echo "[test] pytest ${xdist[*]}"
set +e
"$py" -m pytest "${xdist[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] no tests were collected"; exit 1
fi
exit "$rc"
