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
echo "[test] pytest"
set +e
"$py" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] no tests were collected"; exit 1
fi
exit "$rc"
