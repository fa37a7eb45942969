"""The scheduler side never imports the worker side (shared names live in ``core/``): the
scheduler process must not load the worker's kernels or model-runner glue to schedule a step."""

import subprocess
import sys

SCHEDULER_SIDE = ["boundary_checkpoints.core.scheduler", "boundary_checkpoints.config", "boundary_checkpoints.plugin",
                  "boundary_checkpoints.metrics", "boundary_checkpoints.prompt_capture"]  # fmt: skip


def test_scheduler_side_modules_load_no_worker_module():
    script = (
        "import importlib, sys\n"
        f"for name in {SCHEDULER_SIDE!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('boundary_checkpoints.worker')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
