"""Import layering, checked in fresh processes:

* the scheduler side never imports the worker side (shared names live in ``core/``): the
  scheduler process must not load the worker's kernels or model-runner glue to schedule a step;
* the settings, the gate and the support matrix (and the class wiring they read) import nothing of
  the scheduler, the metrics, the worker or the bench, so every process can parse and gate its
  configuration without loading them, and no import circle runs through them."""

import subprocess
import sys

SCHEDULER_SIDE = ["boundary_checkpoints.core.scheduler", "boundary_checkpoints.settings", "boundary_checkpoints.gate",
                  "boundary_checkpoints.support", "boundary_checkpoints.wiring", "boundary_checkpoints.plugin",
                  "boundary_checkpoints.metrics", "boundary_checkpoints.prompt_capture"]  # fmt: skip
CONFIG_SIDE = ["boundary_checkpoints.settings", "boundary_checkpoints.gate", "boundary_checkpoints.support",
               "boundary_checkpoints.wiring"]  # fmt: skip
CONFIG_SIDE_NEVER_LOADS = ("boundary_checkpoints.core.scheduler", "boundary_checkpoints.metrics",
                           "boundary_checkpoints.worker", "bc_tools.bench")  # fmt: skip


def loaded_after_import(names: list[str], prefixes: tuple[str, ...] | list[str]) -> list[str]:
    """The modules under any of ``prefixes`` that importing ``names`` (in order, in a fresh
    interpreter) loads."""
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"prefixes = {tuple(prefixes)!r}\n"
        "print(sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') for p in prefixes)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return eval(result.stdout.strip().splitlines()[-1])


def test_scheduler_side_modules_load_no_worker_module():
    assert loaded_after_import(SCHEDULER_SIDE, ["boundary_checkpoints.worker"]) == []


def test_settings_gate_and_support_load_no_scheduler_metrics_worker_or_bench():
    assert loaded_after_import(CONFIG_SIDE, CONFIG_SIDE_NEVER_LOADS) == []


def test_the_wiring_names_the_scheduler_mixin_and_classes_that_exist():
    """``wiring`` names the plugin's classes as strings (it must not import them): each name
    resolves, and the mixin it names is the scheduler classes' base."""
    import importlib

    from boundary_checkpoints import wiring

    def resolve(name):
        module, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(module), attr)

    mixin = resolve(wiring.SCHEDULER_MIXIN)
    for name in wiring.SCHEDULER_CLASSES.values():
        assert issubclass(resolve(name), mixin), name
        assert wiring.extends_boundary_scheduler(name) and wiring.extends_boundary_scheduler(resolve(name))
    for name in wiring.WORKER_CLASSES.values():
        assert isinstance(resolve(name), type), name


def test_the_plugin_never_imports_the_tools():
    """``bc_tools`` (benchmark, demo, tiny models) is tooling beside the plugin: no module of
    ``boundary_checkpoints`` imports it."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "boundary_checkpoints"
    offenders = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] == "bc_tools"]
    assert not offenders, offenders
