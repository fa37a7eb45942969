# from the repository root (run 2026-11-30, see machine-turn1.txt); bc-bench = the package's console script
PYTHONPATH=$PWD /work/main/.venv/bin/python -m bc_tools.bench.cli \
  --write-model /tmp/bc-bench-tiny --launch /tmp/bc-bench-tiny \
  --turn1-only --repeat 5 --in-flight 1,8 -N 16 -S 300 -U 60 -A 16 --markdown \
  --log-dir /tmp/bc-bench-runs/turn1/logs --out-json docs/results/cpu-bench/turn1.json
