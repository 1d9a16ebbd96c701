#!/usr/bin/env bash
# The README's main-job command: set up .venv (idempotent), then serve the built-in tiny default through
# `vllm serve MODEL --omni` and print the requests to try once it is ready. Ctrl-C stops it.
#   bash tools/run_default.sh                      # tiny/qwen-image on port 8000
#   bash tools/run_default.sh tiny/qwen2 --port 8001 --gpu-memory-utilization 0.15
#   bash tools/run_default.sh Qwen/Qwen-Image      # a real model (downloads need network)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash tools/setup_env.sh

model=${1:-tiny/qwen-image}
shift || true
port=8000
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" = "--port" ] && port=${args[$((i + 1))]}
done
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

.venv/bin/vllm serve "$model" --omni --port "$port" "$@" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null; wait "$server"' INT TERM

echo "[run_default] starting $model on port $port (first start builds the tiny checkpoint; about a minute)"
for _ in $(seq 1 600); do
  if ! kill -0 "$server" 2>/dev/null; then wait "$server"; exit $?; fi
  if curl -sf "http://localhost:$port/health" >/dev/null 2>&1; then break; fi
  sleep 1
done

url="http://localhost:$port"
cat <<MSG

[run_default] $model is ready at $url. Try (another terminal):

  curl -s $url/v1/models
  curl -s $url/v1/images/generations -H 'Content-Type: application/json' \\
    -d '{"prompt": "a red cube", "size": "64x64", "num_inference_steps": 4, "seed": 0}' \\
    | python3 -c 'import sys,json,base64; open("out.png","wb").write(base64.b64decode(json.load(sys.stdin)["data"][0]["b64_json"]))'
  curl -s $url/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "a red cube"}], "size": "64x64", "num_inference_steps": 4}'
  curl -s $url/metrics | grep vllm_omni

Text chat needs an AR model: bash tools/run_default.sh tiny/qwen2 --gpu-memory-utilization 0.15
  curl -s $url/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}'

Text + speech needs an omni model: bash tools/run_default.sh tiny/qwen3-omni --gpu-memory-utilization 0.15 \\
    --max-model-len 512 --dtype float32
  curl -s $url/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "modalities": ["text", "audio"]}' \\
    | python3 -c 'import sys,json,base64; open("reply.wav","wb").write(base64.b64decode(json.load(sys.stdin)["choices"][0]["message"]["audio"]["data"]))'

Ctrl-C stops the server.
MSG
wait "$server"
