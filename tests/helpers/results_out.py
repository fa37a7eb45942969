"""Where end-to-end tests leave what they measured: ``$BC_RESULTS_DIR`` when it is set (the GPU
host's runs and results runs set it), nowhere otherwise."""

from __future__ import annotations

import json
import os
from pathlib import Path


def results_dir() -> Path | None:
    """``$BC_RESULTS_DIR`` (created), or None when it is not set."""
    out = os.environ.get("BC_RESULTS_DIR")
    if not out:
        return None
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_json(name: str, payload: dict) -> None:
    """Write ``payload`` as ``$BC_RESULTS_DIR/name`` when the variable is set."""
    out = results_dir()
    if out is not None:
        (out / name).write_text(json.dumps(payload, indent=2))
