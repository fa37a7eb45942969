#!/usr/bin/env bash
# GPU host, from the repository root, bundle parts in /tmp/gpu-parts, results under /tmp/r. Two
# commands of under 10 minutes each, on one warm machine:
#   prompt_end_session.sh turns  install; stock and the default prompt checkpoint at P up at once
#                                (serve_pair.sh; $PAIR picks ports and launch order); 8k-token
#                                fresh prompts and next turns at 1 and 8 in flight, 6 rounds
#   prompt_end_session.sh chat   the same servers: a shared system prompt of 2000 and 200 tokens
#                                through /v1/chat/completions (turn 1 only, 32 conversations at 8 in
#                                flight); chat24: the same on a fresh pair of the 24-layer cut
#   prompt_end_session.sh kimi   the servers stop; Kimi-Linear's GPU test
#   prompt_end_session.sh glmfix the GLM-5.3-Flash fixture's GPU exactness test (tests/gpu/test_gpu_families.py)
#   prompt_end_session.sh nemotronmtp  Nemotron-H under MTP k = 1 and 3 on its planted tiny fixture (GPU test)
#   prompt_end_session.sh glmmtp the GLM-5.3-Flash fixture under MTP k = 1, 2, checkpoints on the pool grid (GPU test)
#   prompt_end_session.sh glmmtpunit  the same with the pool as vLLM's prefix match unit (FlashKDA; the plugin
#                                sets it, stock is given it): the run that validates the unit under auto
#                                ($GLM_MTP_KS: the k values, "1 2 3")
#   prompt_end_session.sh glmdflash  the GLM-5.3-Flash fixture under DFlash2 k = 3 (stock alone first; GPU test)
#   prompt_end_session.sh specend  prompt_capture end under MTP k = 1 and 3 on the planted Qwen3-Next (GPU test)
#   prompt_end_session.sh specend2 the same on Nemotron-H under MTP k = 1 and 3 and on Qwen3-Next under DFlash and
#                                DFlash2 k = 3 (GPU test): where they pass, auto can drop the P - 1 stop there
#   prompt_end_session.sh endfamilies  prompt_capture end (auto's default) on Kimi-Linear, Nemotron-H and GLM (GPU test)
#   prompt_end_session.sh bounds   specend and GLM + MTP k = 2 in one call (about 360 s of tests)
#   prompt_end_session.sh copypool one prompt's capture copy on a 60 GiB KV cache vLLM lays out (24 layers of
#                                Qwen3-Next-80B dims): the copier's line and GB/s (benchmarks/gpu/copy_in_pool.py)
#   prompt_end_session.sh glmcrash  GLM fixture under MTP k = 3, drafts accepted: 200 conversations, stock and plugin
#   prompt_end_session.sh glmprobe  GLM fixture under MTP k = 3: the GPU test's probe workload on a fresh engine:
#                                stock with 2- and 3-token prefill rows of its own ($PROBES: also aligned,
#                                request_boundaries) (benchmarks/gpu/glm_mtp_crash_probe.py): whose is the index assert
#   prompt_end_session.sh glm    the servers stop; GLM-5.3-Flash dims (45 layers, dense MLPs) stock
#                                against the default, started one by one: a 5,000-token shared
#                                system prompt, 3 turns, 1 and 8 in flight, 6 rounds; under MTP:
#                                GLM_ARCH=glm5_next_flash_dense_mtp GLM_SPEC='{"method": "mtp", "num_speculative_tokens": 3}'
#                                ($GLM_POLICIES: aligned,request_boundaries; aligned,auto for the defaults); $GLM_LEVELS: in
#                                flight (1,8); $GLM_ANSWER: answer tokens (32; under MTP a next turn recomputes an answer
#                                that ends off the pool grid); $GLM_SHARED: shared prompt tokens (5000; below the 4,608-token
#                                block vLLM splits each prompt at the unit the plugin sets under MTP);
#                                $GLM_SERVER_ARG: one more server argument for both, e.g. '--prefix-match-unit 16';
#                                each server waited for $GLM_STARTUP_TIMEOUT s (420: a bare host compiles everything)
#   prompt_end_session.sh glmfresh glm's pair (kept from glm on an H100) on fresh prompts only (--turn1-only: nothing
#                                reused): $GLM_N conversations (32) of $GLM_SHARED-token prompts (8000), 128-token
#                                answers, $GLM_LEVELS in flight (1,8,32), 6 rounds (issue 30 targets 1-2 on GLM);
#                                GLM_AA=1 (glm, glmfresh): two stock servers instead, the pairing's own spread;
#                                TOGETHER=1 / TOGETHER=0 (glm, glmfresh and the 24-layer stages): the plugin with
#                                shared_hits_together true / false (its default on a GPU: true), labelled
#                                "together" / "apart" (prompts hitting one cached state start in one step or not);
#                                THINK=S (glm and the 24-layer stages): a mean pause of S seconds before each next turn
#   prompt_end_session.sh glmunit  glm's workload under MTP k = 3 (unless GLM_ARCH / GLM_SPEC say otherwise): stock
#                                against $GLM_UNIT_POLICY (aligned: stock again; request_boundaries: the plugin) with
#                                '--prefix-match-unit 16': does stock run with vLLM's own in-chunk KDA checkpoint on
#                                the pool grid (FlashKDA), and what do fresh prompts and later turns cost
#   prompt_end_session.sh pressure  the servers stop; the tiny Qwen3-Next on a 32 MB KV pool that
#                                16 conversations of 2,000-6,700 tokens overflow, turn k of every
#                                conversation before any turn k + 1: stock, the plugin (retention
#                                borrow, the default) and retention hold, all up at once; each waited for
#                                $PRESSURE_STARTUP_TIMEOUT s (420: a bare host's first Triton compile took 121 s of engine init)
#   prompt_end_session.sh turns24  the servers stop; Qwen3-Next-80B dims at 24 layers (64 experts,
#                                12.6 GB of dummy weights), stock against the default, each server
#                                started once and only the slot's awake (bc-bench --sleep-others:
#                                vLLM's sleep mode, 0.6 of the GPU each, which two awake servers
#                                could not take); the turns stage's workload (8k-token first turns
#                                sharing a prefix, and next turns, $TURNS24_LEVELS in flight (1,8), up to 6 rounds);
#                                every 24-layer stage waits $STARTUP24_TIMEOUT s (420) for a server: a bare
#                                H100 without the compile caches took over 300 s; $WARMUP24 (1): warm-up
#                                conversations per start and wake, sent at once; $SERVER24_ARG: one more vllm
#                                argument for every 24-layer server ('--max-num-seqs 256': vLLM's default CUDA
#                                graph ceiling of 512 tokens instead of the stages' 128); GRAPHFIT_AB=1 (turns24):
#                                a third server, the plugin with graph_fit_tokens 0, labelled "nofit"
#   prompt_end_session.sh fresh24  the servers stop; the same 24-layer pair, one awake at a time: fresh prompts
#                                only (--turn1-only: nothing reused), $FRESH_S-token prompts (8000), $FRESH_N
#                                conversations (32) at $FRESH_LEVELS in flight (1,8,32), 128-token answers, 6 rounds
#   prompt_end_session.sh aa24   the fresh24 workload on two stock servers (an A/A pair, one awake at a time)
#   prompt_end_session.sh mtp24  turns24 on the 24-layer cut with its MTP layer, under MTP k = 3, stock against
#                                the plugin with prompt_capture $MTP24_CAPTURE (auto: the checkpoint at P; stop: the P - 1 stop)
#   prompt_end_session.sh pressure24  the pressure stage's workload on the 24-layer pair, each server on a
#                                $PRESSURE24_BYTES KV pool (2.5 GB), one awake at a time; PRESSURE24_AA=1: two
#                                stock servers instead, how far stock's own cached tokens move from round to round;
#                                PRESSURE24_AAB=1: a second stock server beside the pair (labels rotate, so no
#                                server runs two rounds back to back: every round starts on a pool just woken)
#   prompt_end_session.sh nextturn24  the servers stop; what a step of next turns arriving at once costs, stock against
#                                the plugin (benchmarks/step_profile.py --next-turn, in-process engines one after the
#                                other, turns24's settings): 8,100-token prompts answered with 64 tokens, then resent
#                                with 100 more, $NEXT24_BATCHES rows at once (1,8), 6 rounds, the profiled call at the
#                                largest batch; $NEXT24_KWARGS: the engine's vllm.LLM arguments (turns24's: dummy
#                                weights, max_model_len 16384, max_num_seqs 64, so CUDA graphs up to 128 tokens);
#                                NEXT24_NOFIT=1: a third engine, the plugin with graph_fit_tokens 0 ("nofit")
stage=${1:?usage: prompt_end_session.sh turns|chat|chat24|kimi|glmfix|glmmtp|glmmtp2|glmdflash|bounds|specend|specend2|endfamilies|copypool|glmcrash|glmprobe|nemotronmtp|glm|glmfresh|glmunit|glmmtpunit|pressure|pressure24|turns24|mtp24|fresh24|aa24|nextturn24}
mkdir -p /tmp/r/logs
set -u
source .gpu-bundle/install_on_host.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/r/pip.log 2>&1 || { tail /tmp/r/pip.log; exit 1; }
bash benchmarks/gpu/compile_cache.sh restore
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn BC_RESULTS_DIR=/tmp/r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/r/gpu-host.txt; date -u >> /tmp/r/gpu-host.txt
# The 24-layer stages and glm on an H100 keep their servers for the next stage of the same launch
# (bc-bench --keep-servers: a server starts once per session, not once per call); every other stage
# stops them first. Their logs live in /tmp/bc-logs/STAGE and are copied to /tmp/r/logs at the end.
KEPT=/tmp/bc-kept.json
case "$stage" in
  turns24|mtp24|fresh24|aa24|pressure24|glm|glmfresh|glmunit) ;;
  *) python3 -m bc_tools.bench.kept_servers --stop $KEPT ;;
esac
KEEP=(--keep-servers $KEPT --log-dir /tmp/bc-logs/$stage)
# Labels follow serve_pair.sh's $PAIR; the second of an A/A pair is "aligned_b".
IFS=, read -r first second <<< "${PAIR:-aligned,end}"
[[ $second == "$first" ]] && second=${second}_b
U="--url http://127.0.0.1:8100 --label $first --url http://127.0.0.1:8102 --label $second"
L="--server-log /tmp/r/logs/server-8100.log --server-log /tmp/r/logs/server-8102.log"
# Stock against the default on Qwen3-Next-80B dims at 24 layers (64 experts, 12.6 GB of dummy
# weights), each server started once and only the slot's server awake (bc-bench --sleep-others),
# 6 rounds; "$@": the workload and the output.
# TOGETHER=1 / TOGETHER=0: the plugin with shared_hits_together true / false (see the usage above)
TOGETHER_VARIANT='together={"policy": "request_boundaries", "shared_hits_together": true}'
[[ ${TOGETHER:-} == 0 ]] && TOGETHER_VARIANT='apart={"policy": "request_boundaries", "shared_hits_together": false}'
# THINK=S (the serving stages): users pause S seconds on average before each next turn (bc-bench
# --think-time; the same draws for every label), so conversations that start together do not stay in step
THINK_ARGS=()
[[ -n ${THINK:-} ]] && THINK_ARGS=(--think-time "$THINK")
PAIR24=(--policies aligned,request_boundaries)
[[ -n ${TOGETHER:-} ]] && PAIR24=(--policies aligned --variant "$TOGETHER_VARIANT")
pair24() {
  for pid in $(cat /tmp/bc-servers.pids 2> /dev/null); do kill -- -"$pid" 2> /dev/null; done
  sleep 10
  local arch=${ARCH24:-qwen3_next_80b_24l}
  timeout 560 bc-bench --write-model /tmp/$arch --arch $arch --launch /tmp/$arch \
    "${PAIR24[@]}" "${THINK_ARGS[@]}" --sleep-others "${KEEP[@]}" --server-arg='--load-format dummy' \
    ${SPEC24:+--server-arg="--speculative-config '$SPEC24'"} \
    --server-arg='--gpu-memory-utilization 0.6' --server-arg='--max-model-len 16384' \
    --server-arg='--max-num-seqs 64' --server-arg=--no-enforce-eager --additional-config '{"gdn_prefill_backend":"triton"}' \
    ${SERVER24_ARG:+--server-arg="$SERVER24_ARG"} --repeat 6 --warmup "${WARMUP24:-1}" --startup-timeout "${STARTUP24_TIMEOUT:-420}" --markdown "$@"
}
case "$stage" in
  turns)
    bash benchmarks/gpu/serve_pair.sh 330 || exit 1
    bc-bench $U $L --model q --vocab-size 151936 -N 8 -T 2 -S 8000 -U 100 -A 64 --in-flight 1,8 --repeat 6 --time-budget 150 \
      --out-json /tmp/r/turns8k.json --markdown 2>&1 | tee /tmp/r/turns8k.log
    ;;
  chat|chat24)
    if [[ $stage == chat24 ]]; then  # issue 33 §2 at 24 layers: the pair of the 24-layer cut (64 experts, 12.6 GB)
      export ARCH=qwen3_next_80b_24l MODEL=/tmp/q24
      bash benchmarks/gpu/serve_pair.sh 400 || exit 1
    fi
    for S in 2000 200; do
      timeout 100 bc-bench $U $L --model q --vocab-size 151936 --mode chat --tokenizer "${MODEL:-/tmp/q12}" --turn1-only -N 32 -S $S -U 100 -A 32 \
        --in-flight 8 --repeat 6 --time-budget 60 --out-json /tmp/r/chat$S.json --markdown 2>&1 | tee /tmp/r/chat$S.log
    done
    ;;
  kimi)
    for pid in $(cat /tmp/bc-servers.pids); do kill -- -"$pid" 2> /dev/null; done
    sleep 15
    nvidia-smi --query-gpu=memory.used --format=csv >> /tmp/r/gpu-host.txt
    VLLM_KIMI_K3_GEMM_AR=0 timeout 330 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_gpu_families.py \
      -k "kimi and not mtp" 2>&1 | tee /tmp/r/kimi.log | tail -40
    ;;
  glmfix)
    timeout 420 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_gpu_families.py -k "glm5 and not mtp" \
      2>&1 | tee /tmp/r/glmfix.log | tail -40
    ;;
  glmmtp)
    timeout 540 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_gpu_families_mtp.py -k "glm5_next_mtp and pool_grid_stop" \
      2>&1 | tee /tmp/r/glmmtp.log | tail -40
    ;;
  glmmtpunit)  # $GLM_MTP_KS: the k values to run (1 2 3)
    ids=(); for k in ${GLM_MTP_KS:-1 2 3}; do ids+=("tests/gpu/test_gpu_families_mtp.py::test_glm5_next_mtp_boundaries[$k-vllm_unit]"); done
    timeout 560 python3 -m pytest -q -p no:cacheprovider -s "${ids[@]}" 2>&1 | tee /tmp/r/glmmtpunit.log | tail -40
    ;;
  glmmtp2)  # GLM + MTP at k = 2 alone, with the pool-grid stop (one case of glmmtp)
    timeout 420 python3 -m pytest -q -p no:cacheprovider -s "tests/gpu/test_gpu_families_mtp.py::test_glm5_next_mtp_boundaries[2-pool_grid_stop]" \
      2>&1 | tee /tmp/r/glmmtp2.log | tail -40
    ;;
  bounds)  # the tests whose first-token bound is one logit step above each length's references, once live
    timeout 540 python3 -m pytest -q -p no:cacheprovider -s \
      tests/gpu/test_gpu_spec_prompt_end.py::test_prompt_checkpoint_at_p_under_mtp_on_the_gpu \
      "tests/gpu/test_gpu_families_mtp.py::test_glm5_next_mtp_boundaries[2-pool_grid_stop]" 2>&1 | tee /tmp/r/bounds.log | tail -40
    ;;
  specend)
    timeout 540 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_gpu_spec_prompt_end.py -k under_mtp_on_the_gpu \
      2>&1 | tee /tmp/r/specend.log | tail -40
    ;;
  specend2)  # the checkpoint at P on Nemotron-H under MTP and under DFlash / DFlash2 ($SPECEND2_FILTER: fewer cases)
    timeout 540 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_gpu_spec_prompt_end.py \
      -k "${SPECEND2_FILTER:-nemotron_h_under_mtp or under_dflash}" 2>&1 | tee /tmp/r/specend2.log | tail -40
    ;;
  endfamilies)
    timeout 540 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_gpu_spec_prompt_end.py -k other_families \
      2>&1 | tee /tmp/r/endfamilies.log | tail -40
    ;;
  copypool)
    timeout 200 python3 benchmarks/gpu/copy_in_pool.py --out /tmp/r/copy_in_pool.json 2>&1 | grep -v -i warn \
      | tee /tmp/r/copypool.log | tail -12
    ;;
  glmdflash)
    timeout 540 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_gpu_dflash.py -k glm \
      2>&1 | tee /tmp/r/glmdflash.log | tail -40
    ;;
  glmcrash)
    # Issue 32 item 2: GLM + MTP k = 3 with accepted drafts (the planted fixture), stock and the
    # plugin at its defaults (auto: the pool as vLLM's prefix match unit) one by one, 50 conversations
    # of 2 turns a round, 2 rounds: 200 conversations each.
    python3 -c "from bc_tools.fixtures.tiny_models import make_tiny_model as m; m('/tmp/glmmtp', family='glm5_next_mtp_planted')" || exit 1
    timeout 540 bc-bench --launch /tmp/glmmtp --policies aligned,auto --start-one-by-one --log-dir /tmp/r/logs \
      --server-arg="--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'" \
      --server-arg='--gpu-memory-utilization 0.3' --server-arg='--max-model-len 8192' --server-arg=--no-enforce-eager \
      -N 50 -T 2 -S 1000 -U 200 -A 64 --in-flight 8,32 --repeat 2 --time-budget 470 --startup-timeout 200 \
      --out-json /tmp/r/glmcrash.json --markdown 2>&1 | tee /tmp/r/glmcrash.log | tail -40
    ;;
  glmprobe)
    python3 -c "from bc_tools.fixtures.tiny_models import make_tiny_model as m; m('/tmp/glmmtp', family='glm5_next_mtp_planted')" || exit 1
    export VLLM_ENABLE_V1_MULTIPROCESSING=0
    # $PROBES: which engines, one fresh process each (default: stock with short rows only; the GPU
    # test runs plain stock and the plugin on the same workload). The first compiles for 100+ s.
    for run in ${PROBES:-aligned:short_rows}; do
      log=/tmp/r/probe-${run/:/-}.log
      timeout "${PROBE_TIMEOUT:-240}" python3 benchmarks/gpu/glm_mtp_crash_probe.py /tmp/glmmtp ${run/:/ } > "$log" 2>&1
      echo "$run: exit $? $(grep -c 'index out of bounds' "$log") index asserts; $(grep RESULT "$log")"
    done
    ;;
  nemotronmtp)
    timeout 500 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_gpu_families_mtp.py -k nemotron_h_mtp \
      2>&1 | tee /tmp/r/nemotronmtp.log | tail -40
    ;;
  glm|glmfresh|glmunit)
    for pid in $(cat /tmp/bc-servers.pids 2> /dev/null); do kill -- -"$pid" 2> /dev/null; done
    sleep 10
    # 27.9 GiB of weights each: two servers up at once fit an H200 (0.42 of it each); on a smaller
    # GPU (an H100) only one is awake at a time (--sleep-others), with 0.8 of it
    glm_pair=(--start-one-by-one --server-arg='--gpu-memory-utilization 0.42')
    if (($(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) < 100000)); then
      glm_pair=(--sleep-others "${KEEP[@]}" --server-arg='--gpu-memory-utilization 0.8')
    fi
    policies=(--policies "${GLM_POLICIES:-aligned,request_boundaries}")  # aligned,auto: the plugin's defaults
    # GLM_AA=1: two stock servers (an A/A pair): the spread the pairing alone gives at GLM dims
    [[ -n ${GLM_AA:-} ]] && policies=(--policies aligned --variant 'aligned_b={"policy": "aligned"}')
    [[ -n ${TOGETHER:-} ]] && policies=(--policies aligned --variant "$TOGETHER_VARIANT")
    if [[ $stage == glmunit ]]; then
      GLM_ARCH=${GLM_ARCH:-glm5_next_flash_dense_mtp}
      [[ -n ${GLM_SPEC:-} ]] || GLM_SPEC='{"method": "mtp", "num_speculative_tokens": 3}'
      unit_policy=${GLM_UNIT_POLICY:-aligned}
      policies=(--policies aligned --variant "${unit_policy}_unit16={\"policy\": \"$unit_policy\"}"
        --variant-arg "${unit_policy}_unit16=--prefix-match-unit 16")
    fi
    workload=(-N 8 -T 3 -S "${GLM_SHARED:-5000}" -U 100 -A "${GLM_ANSWER:-32}" --in-flight "${GLM_LEVELS:-1,8}")
    if [[ $stage == glmfresh ]]; then
      workload=(--turn1-only -N "${GLM_N:-32}" -S "${GLM_SHARED:-8000}" -U 100 -A 128 --in-flight "${GLM_LEVELS:-1,8,32}")
    fi
    timeout 560 bc-bench --write-model /tmp/glm --arch ${GLM_ARCH:-glm5_next_flash_dense} --launch /tmp/glm \
      --log-dir /tmp/r/logs "${policies[@]}" "${glm_pair[@]}" --server-arg='--load-format dummy' \
      ${GLM_SPEC:+--server-arg="--speculative-config '$GLM_SPEC'"} \
      --server-arg='--max-model-len 20000' \
      --server-arg='--max-num-seqs 64' --server-arg=--no-enforce-eager ${GLM_SERVER_ARG:+--server-arg="$GLM_SERVER_ARG"} \
      "${workload[@]}" "${THINK_ARGS[@]}" --repeat 6 --time-budget ${GLM_BUDGET:-520} --startup-timeout "${GLM_STARTUP_TIMEOUT:-420}" \
      --out-json /tmp/r/$stage.json --markdown 2>&1 | tee /tmp/r/$stage.log | tail -60
    ;;
  pressure)
    for pid in $(cat /tmp/bc-servers.pids 2> /dev/null); do kill -- -"$pid" 2> /dev/null; done
    sleep 10
    timeout 540 bc-bench --write-model /tmp/tiny --arch tiny --launch /tmp/tiny --policies aligned,request_boundaries \
      --variant 'hold={"policy":"request_boundaries","retention":"hold"}' --log-dir /tmp/r/logs \
      --server-arg='--kv-cache-memory-bytes 32000000' --server-arg='--gpu-memory-utilization 0.2' \
      --server-arg='--max-model-len 8192' --server-arg='--max-num-seqs 64' --server-arg=--no-enforce-eager \
      --additional-config '{"gdn_prefill_backend":"triton"}' \
      -N 16 -T 3 -S 2000 -U 1500 -A 64 --in-flight 8 --turn-order rounds --repeat 6 --time-budget ${PRESSURE_BUDGET:-300} --startup-timeout ${PRESSURE_STARTUP_TIMEOUT:-420} \
      --out-json /tmp/r/pressure.json --markdown 2>&1 | tee /tmp/r/pressure.log | tail -60
    ;;
  turns24|mtp24)
    # mtp24: the same on the cut with its MTP layer, under MTP k = 3 (dummy weights reject the
    # drafts); the plugin as $MTP24_CAPTURE takes its prompt checkpoint (auto, the default: at P, no
    # stop; stop: the P - 1 stop auto took before)
    variant=()
    if [[ $stage == mtp24 ]]; then
      export ARCH24=qwen3_next_80b_24l_mtp SPEC24='{"method": "mtp", "num_speculative_tokens": 3}'
      capture=${MTP24_CAPTURE:-auto}
      variant=(--policies aligned --variant "$capture={\"policy\": \"request_boundaries\", \"prompt_capture\": \"$capture\"}")
    fi
    [[ -n ${GRAPHFIT_AB:-} ]] && variant+=(--variant 'nofit={"policy": "request_boundaries", "graph_fit_tokens": 0}')
    # Expected wall time about 530 s: 10 s pause, then bc-bench's --time-budget 500 (two servers
    # started one by one, about 100 s each; rounds while they fit, each slot after a switch adding a
    # sleep, a wake and a warm-up of about 1.5 s, in the JSON's servers.*.sleep_others), then the
    # servers' stop (seconds; at most 25 s each). timeout 560 bounds bc-bench whatever happens.
    pair24 "${variant[@]}" -N 8 -T 2 -S 8000 -U 100 -A 64 --in-flight "${TURNS24_LEVELS:-1,8}" --time-budget "${TURNS24_BUDGET:-500}" --out-json /tmp/r/$stage.json \
      2>&1 | tee /tmp/r/$stage.log | tail -60
    nvidia-smi --query-gpu=memory.used --format=csv >> /tmp/r/gpu-host.txt
    ;;
  fresh24|aa24)
    # Issue 30 targets 1-2: traffic without reuse, one server awake at a time (turns24's pair);
    # aa24: the same with two stock servers, what the pairing alone gives.
    pairing=()
    [[ $stage == aa24 ]] && pairing=(--policies aligned --variant 'aligned_b={"policy": "aligned"}')
    pair24 "${pairing[@]}" --turn1-only -N "${FRESH_N:-32}" -S "${FRESH_S:-8000}" -U 100 -A 128 --in-flight "${FRESH_LEVELS:-1,8,32}" \
      --time-budget "${FRESH_BUDGET:-500}" --out-json /tmp/r/$stage.json 2>&1 | tee /tmp/r/$stage.log | tail -60
    ;;
  nextturn24)
    bc-bench --write-model /tmp/qwen3_next_80b_24l --arch qwen3_next_80b_24l > /dev/null || exit 1
    engine='{"load_format": "dummy", "max_model_len": 16384, "max_num_seqs": 64}'
    nofit=()  # NEXT24_NOFIT=1: a third engine, the plugin with graph_fit_tokens 0 (label "nofit")
    [[ -n ${NEXT24_NOFIT:-} ]] && nofit=(--variant 'nofit={"policy": "request_boundaries", "prompt_capture": "in_step", "graph_fit_tokens": 0}')
    timeout 560 python3 benchmarks/step_profile.py --model /tmp/qwen3_next_80b_24l --configs aligned,in_step \
      --batch "${NEXT24_BATCHES:-1,8}" --prompt-len 8100 --answer 64 --next-turn 100 --repeat 6 \
      --llm-kwargs "${NEXT24_KWARGS:-$engine}" \
      --additional-config '{"gdn_prefill_backend": "triton"}' --gpu-memory-utilization 0.6 "${nofit[@]}" \
      --out /tmp/r/$stage.json --torch-profile /tmp/r/$stage-profile 2>&1 | grep -v -i warn | tee /tmp/r/$stage.log | tail -40
    ;;
  pressure24)
    # Issue 30 target 4 at real dims: the pressure stage's workload on turns24's pair, each server
    # with a KV pool of $PRESSURE24_BYTES (2.5 GB: about 190 blocks of 13 MB, each a 1056-token
    # page or a recurrent state; 8 running requests hold about 80, and the 16 conversations' turn-2
    # chains need about 110), turn k of every conversation before any turn k + 1. Read "requests
    # cached below stock" and stock's own cached-token ratio (near 0: every chain thrashed for both,
    # raise the bytes; no eviction in the logs: lower them).
    [[ -n ${PRESSURE24_AA:-} ]] && PAIR24=(--policies aligned --variant 'aligned_b={"policy": "aligned"}')
    [[ -n ${PRESSURE24_AAB:-} ]] && PAIR24+=(--variant 'aligned_b={"policy": "aligned"}')
    pair24 --server-arg="--kv-cache-memory-bytes ${PRESSURE24_BYTES:-2500000000}" \
      -N 16 -T 3 -S 2000 -U 1500 -A 64 --in-flight 8 --turn-order rounds --time-budget "${PRESSURE24_BUDGET:-480}" \
      --out-json /tmp/r/$stage.json 2>&1 | tee /tmp/r/$stage.log | tail -60
    ;;
esac
status=$?
cp /tmp/bc-logs/"$stage"/*.log /tmp/r/logs/ 2> /dev/null
# Which path copied the KV cache's pages in this stage's engines (docs/notes/next-gpu-session.md).
grep -rhaoE "boundary_checkpoints: page copies: [^\"]*" /tmp/r 2> /dev/null | sort | uniq -c | head -4
# New prompts that waited for a shared prefix in flight (speculative decoding), per server log: its last count.
for log in /tmp/r/logs/server*.log; do
  [[ -f $log ]] && grep -aoE "prompts_waited=[0-9]+" "$log" | tail -1 | sed "s|^|$(basename "$log"): |"
done
exit $status
