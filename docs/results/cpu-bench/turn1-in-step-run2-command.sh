# from the repository root (run 2 of 2026-12-01, 05:19 UTC, see turn1-in-step-machine.txt); bc-bench = the package's console script
# three servers up at once: stock `aligned`, `request_boundaries` (prompt_capture auto -> in_step on CPU),
# and `stop` (request_boundaries with prompt_capture "stop", the P - 1 stop)
PYTHONPATH=$PWD /work/main/.venv/bin/python -m bc_tools.bench.cli \
  --write-model /tmp/bc-bench-tiny --launch /tmp/bc-bench-tiny \
  --variant 'stop={"policy": "request_boundaries", "prompt_capture": "stop"}' \
  --turn1-only --repeat 5 --in-flight 1,8 -N 16 -S 300 -U 60 -A 16 --markdown \
  --log-dir /tmp/bc-bench-turn1/logs-run2 --out-json docs/results/cpu-bench/turn1-in-step-run2.json
