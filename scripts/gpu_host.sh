#!/usr/bin/env bash
# Bundle: `PART_MB=47 bash ../shared/gpu/build_bundle.sh` here (each transfer carries the working
# tree, about 16 MB, beside one part, and may not exceed 64 MiB), then send each part into
# /tmp/gpu-parts on the host. Files back from $OUT are capped at 8: run a stage with OUT set to a
# scratch folder and tar that folder into the real $OUT.
# Runs on the GPU host (through the device tool) once every bundle part sits in /tmp/gpu-parts:
#   bash scripts/gpu_host.sh probes   kernel tests, copy-kernel benchmark, end-to-end probes
#   bash scripts/gpu_host.sh tests [PYTEST ARGS]  every gpu-marked test (over 10 minutes as a whole: split it
#                                     with -k, e.g. -k "not gpu_families and not dflash", then the rest)
#   bash scripts/gpu_host.sh all      every gpu-marked test, then the copy-kernel benchmark
#   bash scripts/gpu_host.sh kernel   kernel tests and the copy-kernel benchmark without its sweep
#   bash scripts/gpu_host.sh bench    multi-turn serving benchmark (bc-bench), stock vs plugin
#   bash scripts/gpu_host.sh in_step  in-step prompt capture: the GDN split against the two-step stop on a
#                                     real layer, and the probes with no P - 1 stop (tests/worker/test_gdn_split.py,
#                                     tests/gpu/test_gpu_in_step.py; gpu-marked tests only)
#   bash scripts/gpu_host.sh families [PYTEST ARGS]  MTP (k = 1, 3) and the GLM / Kimi / Nemotron-H
#                                     tiny families end to end (tests/gpu/test_gpu_families.py, without
#                                     speculative decoding, and tests/gpu/test_gpu_families_mtp.py only;
#                                     e.g. -k qwen3_next_mtp, -k glm5_next_mtp (GLM under MTP: where vLLM's
#                                     indexer needs uniform decode rows, the H200 among them, it checks the
#                                     refusal, docs/notes/model-families.md §13) or -k "not mtp"
#                                     to split it under the 10-minute command limit)
#   bash scripts/gpu_host.sh run CMD [ARGS]  any command in this environment (bundle, package, results dir), e.g.
#                                     run python3 benchmarks/step_profile.py ... (its docstring has the command)
#   bash scripts/gpu_host.sh dflash [PYTEST ARGS]  DFlash and DFlash2 (k = 3, full + sliding draft layers)
#                                     end to end (tests/gpu/test_gpu_dflash.py only; -k "not glm" the Qwen3-Next
#                                     cases, -k glm the GLM-5.3-Flash DFlash2 case, under the 10-minute limit)
# Results and logs go to $OUT (the device tool's output folder) or /tmp/bc-out.
set -uo pipefail
stage="${1:?usage: gpu_host.sh probes|tests|all|kernel|bench|run|in_step|families|dflash}"
out="${OUT:-/tmp/bc-out}"
mkdir -p "$out"
source .gpu-bundle/install_on_host.sh || exit 1
# A vLLM server that an earlier call's time limit cut (bc-bench starts each server in its own
# session, which the device tool leaves running) holds GPU memory, and the next engine's memory
# check then fails (docs/results/gpu-session17-h200.md): stop any such leftover before this stage starts.
vllm_processes='vllm\.entrypoints|VLLM::EngineCore'
leftover=$(pgrep -f "$vllm_processes" | tr '\n' ' ')
if [[ -n "$leftover" ]]; then
  echo "stopping leftover vLLM processes of an earlier call: $leftover"
  pkill -9 -f "$vllm_processes"; sleep 5
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$out/pip.log" 2>&1 || { tail "$out/pip.log"; exit 1; }
export HF_HUB_OFFLINE=1 BC_RESULTS_DIR="$out" PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu-host.txt"
date -u >> "$out/gpu-host.txt"
rc=0
case "$stage" in
  probes)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/worker/test_kernels.py 2>&1 | tee "$out/gpu-kernel-tests.log" || rc=1
    python3 benchmarks/copy_kernel.py --out "$out/gpu-copy-kernel.json" 2>&1 | tee "$out/gpu-copy-kernel.log" || rc=1
    python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_gpu_e2e.py 2>&1 | tee "$out/gpu-e2e.log" || rc=1
    ;;
  tests)
    shift
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/ "$@" 2>&1 | tee "$out/gpu-tests.log" || rc=1
    ;;
  all)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$out/gpu-tests.log" || rc=1
    python3 benchmarks/copy_kernel.py --out "$out/gpu-copy-kernel.json" 2>&1 | tee "$out/gpu-copy-kernel.log" || rc=1
    ;;
  kernel)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/worker/test_kernels.py 2>&1 | tee "$out/gpu-kernel-tests.log" || rc=1
    python3 benchmarks/copy_kernel.py --no-sweep --out "$out/gpu-copy-kernel.json" 2>&1 | tee "$out/gpu-copy-kernel.log" || rc=1
    ;;
  in_step)
    python3 -m pytest -q -p no:cacheprovider -rA -s -m gpu tests/worker/test_gdn_split.py tests/gpu/test_gpu_in_step.py 2>&1 | tee "$out/gpu-in-step.log" || rc=1
    ;;
  families)
    shift
    python3 -m pytest -q -p no:cacheprovider -rA -s tests/gpu/test_gpu_families.py tests/gpu/test_gpu_families_mtp.py "$@" 2>&1 | tee "$out/gpu-spec-families.log" || rc=1
    ;;
  dflash)
    shift
    python3 -m pytest -q -p no:cacheprovider -rA -s tests/gpu/test_gpu_dflash.py "$@" 2>&1 | tee "$out/gpu-dflash.log" || rc=1
    ;;
  bench)
    shift
    bc-bench "$@" 2>&1 | tee "$out/gpu-multi-turn.log" || rc=1
    ;;
  run)
    shift
    "$@" 2>&1 | tee "$out/gpu-run.log" || rc=1
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
exit $rc
