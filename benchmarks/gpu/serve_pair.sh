#!/usr/bin/env bash
# On the GPU host (after `source .gpu-bundle/install_on_host.sh` and the package's install): write the
# 12-layer Qwen3-Next-80B-dims model (dummy weights, 38 GiB) and start two servers of it at once
# (0.45 of the GPU each with a fixed 16 GB KV cache: two engines that profile memory at the same time
# count each other's allocations, and one finds none left for its cache), CUDA graphs on, the FLA
# Triton GDN prefill kernel for both (the bundle cannot load FlashInfer's):
#   $PAIR (default "aligned,end") names what runs on :8100 and :8102, started in that order:
#   aligned = stock, end = the plugin's default (the prompt checkpoint at P, copied after the step
#   that computes it). "end,aligned" swaps ports and launch order; "aligned,aligned" is an A/A pair
#   that measures what the pairing itself adds.
# Waits until both answer /health (or $1 seconds pass); PIDs in /tmp/bc-servers.pids, logs in $LOGS.
set -u
deadline=$(( $(date +%s) + ${1:-420} ))
LOGS=${LOGS:-/tmp/r/logs}; mkdir -p "$LOGS"
MODEL=${MODEL:-/tmp/q12}  # with ARCH: another real-size arch, e.g. ARCH=qwen3_next_80b_24l MODEL=/tmp/q24
[[ -d $MODEL ]] || bc-bench --write-model "$MODEL" --arch "${ARCH:-qwen3_next_80b_12l}" > "$LOGS/write-model.log" 2>&1 || exit 1
declare -A CONFIG=(
  [aligned]='{"gdn_prefill_backend":"triton","boundary_checkpoints":{"policy":"aligned"}}'
  [end]='{"gdn_prefill_backend":"triton","boundary_checkpoints":{"policy":"request_boundaries","prompt_capture":"end","stats_log_interval_s":5}}'
)
IFS=, read -r first second <<< "${PAIR:-aligned,end}"
declare -A ROLE=([8100]=$first [8102]=$second)
: > /tmp/bc-servers.pids
for port in 8100 8102; do
  setsid python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name q --port "$port" \
    --host 127.0.0.1 --dtype bfloat16 --mamba-ssm-cache-dtype float32 --max-model-len 16384 --load-format dummy \
    --enable-prefix-caching --enable-prompt-tokens-details --gpu-memory-utilization 0.45 --kv-cache-memory-bytes 16000000000 \
    --additional-config "${CONFIG[${ROLE[$port]}]}" > "$LOGS/server-$port.log" 2>&1 &
  echo $! >> /tmp/bc-servers.pids
done
for port in 8100 8102; do
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    if (( $(date +%s) > deadline )); then echo "server $port not healthy in time"; tail -5 "$LOGS/server-$port.log"; exit 1; fi
    sleep 2
  done
  echo "server $port healthy after $(( $(date +%s) - deadline + ${1:-420} )) s"
done
grep -h "boundary_checkpoints: request_boundaries active" "$LOGS"/server-810*.log || echo "no plugin server in this pair"
