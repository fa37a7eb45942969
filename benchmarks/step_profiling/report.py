"""The summary, printed report and JSON output of ``benchmarks/step_profile.py``."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from bc_tools.bench.cli import machine_info
from bc_tools.bench.report import format_table
from bc_tools.bench.stats import percentile, spread

from .engine import MODES, model_steps
from .trace import attribution_lines

SYNC_NOTE = (
    "synced calls: torch.cuda.synchronize() before execute_model, after it and after sample_tokens "
    "(device-complete step times, no async-scheduling overlap); async calls: no added synchronization "
    "(step times are host times)"
)

# ---------------------------------------------------------------------------------------------
# summary


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def calls_of(result: dict, batch: int, mode: str) -> list[dict]:
    return [c for c in result["calls"] if c["batch"] == batch and c["mode"] == mode]


def step_ms(step: dict) -> float:
    return 1e3 * (step["execute_s"] + step["sample_s"])


def step_spread(steps: list[dict]) -> dict:
    return {"ms": spread(step_ms(s) for s in steps), "tokens": percentile((s["tokens"] for s in steps), 50)}


def summarize_batch(result: dict, batch: int, reference: dict | None) -> dict:
    """Spreads over rounds of one configuration at one batch size; step times from synced calls."""
    by_mode = {mode: calls_of(result, batch, mode) for mode in MODES}
    synced_steps = [s for c in by_mode["synced"] for s in model_steps(c)]
    calls = [*by_mode["async"], *by_mode["synced"]]
    summary = {f"generate_ms_{mode}": spread(ms(c["generate_s"]) for c in by_mode[mode]) for mode in MODES}
    summary.update({
        "steps_per_call": percentile((len(model_steps(c)) for c in calls), 50),
        "capture_steps_per_call": percentile((sum(s["carries_captures"] for s in model_steps(c)) for c in calls), 50),
        "capture_steps": step_spread([s for s in synced_steps if s["carries_captures"]]),
        "other_steps": step_spread([s for s in synced_steps if not s["carries_captures"]]),
        "host_ms_per_step": spread(ms(s["schedule_s"] + s["update_s"]) for s in synced_steps),
        "cached_tokens": sum(c["cached_tokens"] for c in calls),
    })  # fmt: skip
    if reference is not None:
        pairs = zip(sorted(by_mode["async"], key=lambda c: c["rep"]),
                    sorted(calls_of(reference, batch, "async"), key=lambda c: c["rep"]))  # fmt: skip
        summary["vs_reference_async"] = spread(c["generate_s"] / r["generate_s"] for c, r in pairs)
    return summary


def summarize(results: dict, batches: list[int]) -> dict:
    """Per configuration and batch size; ratios against the first configuration, round by round."""
    reference = next(iter(results.values()), None)
    return {label: {str(b): summarize_batch(r, b, None if r is reference else reference) for b in batches}
            for label, r in results.items()}  # fmt: skip


def fmt_spread(s: dict, digits: int = 1) -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['p25']:.{digits}f}..{s['p75']:.{digits}f}]"


def fmt_steps(s: dict) -> str:
    return "-" if s["ms"]["median"] is None else f"{s['ms']['median']:.1f} ({s['tokens']:.0f} tok, n={s['ms']['n']})"


def batch_table(summary: dict, batch: int) -> str:
    header = ["config", "call ms async", "/first", "call ms synced", "steps", "capture steps",
              "capture step ms", "other step ms", "host ms/step"]  # fmt: skip
    rows = []
    for label, per_batch in summary.items():
        s = per_batch[str(batch)]
        ratio = s.get("vs_reference_async")
        rows.append([label, fmt_spread(s["generate_ms_async"]), fmt_spread(ratio, 3) if ratio else "-",
                     fmt_spread(s["generate_ms_synced"]), f"{s['steps_per_call']:.0f}",
                     f"{s['capture_steps_per_call']:.0f}", fmt_steps(s["capture_steps"]), fmt_steps(s["other_steps"]),
                     fmt_spread(s["host_ms_per_step"], 2)])  # fmt: skip
    return f"batch {batch} (median [p25..p75] over rounds; step ms from synced calls)\n" + format_table(header, rows)


def configuration_line(label: str, result: dict, batch: int) -> str:
    """Median step time of the largest batch's synced steps that carry capture rows vs the rest, and
    the profiled call's synchronizations (counts, then the busiest Python lines)."""
    steps = [s for c in calls_of(result, batch, "synced") for s in model_steps(c)]
    capture = step_spread([s for s in steps if s["carries_captures"]])
    other = step_spread([s for s in steps if not s["carries_captures"]])
    line = f"{label}: batch {batch}: capture steps {fmt_steps(capture)}; other steps {fmt_steps(other)}"
    profile = result.get("profile")
    if profile and "error" in profile:
        line += f"; profile failed: {profile['error']}"
    elif profile:
        syncs = ", ".join(f"{k} {v}" for k, v in profile["sync_counts"].items() if v)
        line += f"; profiled call (batch {profile['batch']}): {profile['steps']} steps"
        line += f", syncs: {syncs or 'none recorded'}"
        line += "".join(f"\n    {site['count']:6d}  {site['site']}" for site in profile["sync_sites"][:5])
        if "attribution" in profile:
            line += "".join(f"\n    steps: {text}" for text in attribution_lines(profile["attribution"]))
    return line


# ---------------------------------------------------------------------------------------------
# output


def machine(cuda: bool) -> dict:
    import torch
    import vllm

    info = {**machine_info(), "torch": torch.__version__, "torch_cuda": torch.version.cuda, "vllm": vllm.__version__,
            "cuda_available": cuda, "gpu": None, "git_commit": None}  # fmt: skip
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        info["gpu"] = command_output(query)
    info["git_commit"] = command_output(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"])
    return info


def command_output(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
