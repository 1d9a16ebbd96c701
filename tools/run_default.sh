#!/usr/bin/env bash
# The README's main-job command: set up .venv (idempotent), then serve built-in tiny defaults through
# `vllm serve MODEL --omni` and print the requests to try once they are ready. Ctrl-C stops everything.
#   bash tools/run_default.sh                  # tiny/qwen3-omni (chat: text + audio) on 127.0.0.1:8000,
#                                              # tiny/qwen-image (images routes) on 127.0.0.1:8001
#   bash tools/run_default.sh --host 0.0.0.0 --port 9000 --port2 9001   # where the two listen
#   bash tools/run_default.sh tiny/qwen2 --port 8002 --gpu-memory-utilization 0.15   # one model, your flags
#   bash tools/run_default.sh Qwen/Qwen-Image  # a real model (downloads need network)
# --host defaults to 127.0.0.1 (a demo stays on this machine); --api-key KEY is passed on and used in the curls.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash tools/setup_env.sh
venv=${VLLM_OMNI_VENV:-$root/.venv}  # the one setup_env.sh set up
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' INT TERM

host=127.0.0.1
port=8000
port2=8001
api_key=
model=
args=()  # flags for `vllm serve` (one-model mode)
while [ $# -gt 0 ]; do
  case $1 in
    --host) host=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --port2) port2=$2; shift 2 ;;
    --api-key) api_key=$2; args+=("$1" "$2"); shift 2 ;;
    -*) args+=("$1"); shift ;;
    *) if [ -z "$model" ] && [ ${#args[@]} -eq 0 ]; then model=$1; else args+=("$1"); fi; shift ;;
  esac
done
[ -n "$api_key" ] && auth=" -H 'Authorization: Bearer $api_key'" || auth=
# A server listening on all interfaces is still reached here through the loopback address.
[ "$host" = 0.0.0.0 ] || [ "$host" = "::" ] && client_host=127.0.0.1 || client_host=$host

serve() {  # serve MODEL PORT [flags...]: start in the background
  local model=$1 port=$2
  shift 2
  echo "[run_default] starting $model on $host:$port (the first start builds the tiny checkpoint)"
  "$venv/bin/vllm" serve "$model" --omni --host "$host" --port "$port" "$@" &
  pids+=($!)
}

wait_ready() {  # wait_ready PORT PID
  for _ in $(seq 1 900); do
    if ! kill -0 "$2" 2>/dev/null; then
      echo "[run_default] server on :$1 exited"
      kill -TERM "${pids[@]}" 2>/dev/null
      exit 1
    fi
    if curl -sf "http://$client_host:$1/health" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "[run_default] server on :$1 not ready after 900 s"; exit 1
}

chat_help() {
  cat <<MSG
  curl -s $1/v1/chat/completions -H 'Content-Type: application/json'$auth \\
    -d '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}'
MSG
}

chat_audio_help() {
  cat <<MSG
  # chat, text + audio (base64 WAV in choices[0].message.audio.data)
  curl -s $1/v1/chat/completions -H 'Content-Type: application/json'$auth \\
    -d '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "modalities": ["text", "audio"]}' \\
    | python3 -c 'import sys,json,base64; open("reply.wav","wb").write(base64.b64decode(json.load(sys.stdin)["choices"][0]["message"]["audio"]["data"]))'
  curl -s $1/v1/audio/speech -H 'Content-Type: application/json'$auth -d '{"input": "hello"}' -o speech.wav
MSG
}

images_help() {
  cat <<MSG
  curl -s $1/v1/images/generations -H 'Content-Type: application/json'$auth \\
    -d '{"prompt": "a red cube", "size": "64x64", "num_inference_steps": 4, "seed": 0}' \\
    | python3 -c 'import sys,json,base64; open("out.png","wb").write(base64.b64decode(json.load(sys.stdin)["data"][0]["b64_json"]))'
MSG
}

video_help() {
  cat <<MSG
  curl -s $1/v1/videos/sync -H 'Content-Type: application/json'$auth \\
    -d '{"prompt": "a red cube", "size": "64x64", "num_frames": 5, "num_inference_steps": 2, "seed": 0}' -o out.mp4
MSG
}

if [ -z "$model" ]; then
  serve tiny/qwen3-omni "$port" --gpu-memory-utilization 0.15 --max-model-len 512 --dtype float32 "${args[@]}"
  serve tiny/qwen-image "$port2" "${args[@]}"
  wait_ready "$port" "${pids[0]}"
  wait_ready "$port2" "${pids[1]}"
  echo
  echo "[run_default] ready (random tiny weights: they prove the stack, the outputs are noise). Try:"
  chat_audio_help "http://$client_host:$port"
  images_help "http://$client_host:$port2"
  echo "  curl -s http://$client_host:$port/metrics | grep vllm_omni"
else
  outputs=$("$venv/bin/python" tools/model_outputs.py "$model")
  serve "$model" "$port" "${args[@]}"
  wait_ready "$port" "${pids[0]}"
  url="http://$client_host:$port"
  echo
  echo "[run_default] $model is ready at $url. Try:"
  echo "  curl -s $url/v1/models$auth"
  case $outputs in
    image) images_help "$url" ;;
    video) video_help "$url" ;;
    chat-audio) chat_audio_help "$url" ;;
    *) chat_help "$url" ;;
  esac
fi
echo "Ctrl-C stops the server(s)."
wait
