"""A repository script (a benchmark, a GPU test module) loaded as a module of its own name, so a
test calls its functions without running it as a program or collecting its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative_path: str, name: str) -> ModuleType:
    """``ROOT / relative_path`` executed as the module ``name`` (registered in ``sys.modules``:
    dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
