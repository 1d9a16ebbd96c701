#!/usr/bin/env bash
# The README's main-job command: set up .venv (idempotent), then serve built-in tiny defaults through
# `vllm serve MODEL --omni` and print the requests to try once they are ready. Ctrl-C stops everything.
#   bash tools/run_default.sh                  # tiny/qwen3-omni (chat: text + audio) on :8000,
#                                              # tiny/qwen-image (images routes) on :8001
#   bash tools/run_default.sh tiny/qwen2 --port 8002 --gpu-memory-utilization 0.15   # one model, your flags
#   bash tools/run_default.sh Qwen/Qwen-Image  # a real model (downloads need network)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash tools/setup_env.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' INT TERM

serve() {  # serve MODEL PORT [flags...]: start in the background
  local model=$1 port=$2
  shift 2
  echo "[run_default] starting $model on port $port (the first start builds the tiny checkpoint)"
  .venv/bin/vllm serve "$model" --omni --port "$port" "$@" &
  pids+=($!)
}

wait_ready() {  # wait_ready PORT PID
  for _ in $(seq 1 900); do
    if ! kill -0 "$2" 2>/dev/null; then
      echo "[run_default] server on :$1 exited"
      kill -TERM "${pids[@]}" 2>/dev/null
      exit 1
    fi
    if curl -sf "http://localhost:$1/health" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "[run_default] server on :$1 not ready after 900 s"; exit 1
}

chat_audio_help() {
  cat <<MSG
  # chat, text + audio (base64 WAV in choices[0].message.audio.data)
  curl -s $1/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "modalities": ["text", "audio"]}' \\
    | python3 -c 'import sys,json,base64; open("reply.wav","wb").write(base64.b64decode(json.load(sys.stdin)["choices"][0]["message"]["audio"]["data"]))'
  curl -s $1/v1/audio/speech -H 'Content-Type: application/json' -d '{"input": "hello"}' -o speech.wav
MSG
}

images_help() {
  cat <<MSG
  curl -s $1/v1/images/generations -H 'Content-Type: application/json' \\
    -d '{"prompt": "a red cube", "size": "64x64", "num_inference_steps": 4, "seed": 0}' \\
    | python3 -c 'import sys,json,base64; open("out.png","wb").write(base64.b64decode(json.load(sys.stdin)["data"][0]["b64_json"]))'
MSG
}

if [ $# -eq 0 ]; then
  serve tiny/qwen3-omni 8000 --gpu-memory-utilization 0.15 --max-model-len 512 --dtype float32
  serve tiny/qwen-image 8001
  wait_ready 8000 "${pids[0]}"
  wait_ready 8001 "${pids[1]}"
  echo
  echo "[run_default] ready (random tiny weights: they prove the stack, the outputs are noise). Try:"
  chat_audio_help http://localhost:8000
  images_help http://localhost:8001
  echo "  curl -s http://localhost:8000/metrics | grep vllm_omni"
else
  model=$1
  shift
  port=8000
  args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    [ "${args[$i]}" = "--port" ] && port=${args[$((i + 1))]}
  done
  serve "$model" "$port" "$@"  # a --port in "$@" repeats the same value
  wait_ready "$port" "${pids[0]}"
  url="http://localhost:$port"
  echo
  echo "[run_default] $model is ready at $url. Try:"
  echo "  curl -s $url/v1/models"
  images_help "$url"
  echo "  curl -s $url/v1/chat/completions -H 'Content-Type: application/json' \\"
  echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], \"max_tokens\": 16}'"
fi
echo "Ctrl-C stops the server(s)."
wait
