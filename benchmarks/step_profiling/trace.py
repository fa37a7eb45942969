"""The torch profile of one call and the step attribution of its chrome trace, for
``benchmarks/step_profile.py`` (its docstring says what each number is)."""

from __future__ import annotations

import gzip
import json
import time
import warnings
from bisect import bisect_left, bisect_right
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

from .engine import STEP_KINDS, STEP_RANGE, StepRecorder, model_steps, timed_call

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "aten::item", "aten::_local_scalar_dense")  # fmt: skip
DTOH_COPY_PREFIX = "Memcpy DtoH"
TORCH_SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's sync debug mode "warn"
TOP_SYNC_SITES = 20
TOP_OPS = 30
SORT_KEYS = {"self_cuda": "self_device_time_total", "self_cpu": "self_cpu_time_total"}
# the custom op wrapping one layer's recurrent (GDN) core: stock CUDA, stock CPU (forward_cpu), and
# the plugin's CPU subclass, which runs forward_cuda and so the CUDA op name
CORE_OPS = ("vllm::qwen_gdn_attention_core", "vllm::qwen_gdn_attention_core_fused_norm_packed",
            "vllm::cpu_gdn_attention_core")  # fmt: skip
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
DEVICE_STEP_CATEGORY = "gpu_user_annotation"
NESTING_SLACK_US = 0.002  # chrome-trace times are rounded to 1 ns: an end may pass its parent's by that
TOP_CHILDREN = 12
TOP_KERNELS = 10
TOP_DETAIL = 8  # children and kernels printed by --attribute

# ---------------------------------------------------------------------------------------------
# torch profile


def top_ops(averages, key: str) -> list[dict]:
    ranked = sorted(averages, key=lambda event: getattr(event, key), reverse=True)[:TOP_OPS]
    return [{"name": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total,
             "self_cuda_us": e.self_device_time_total, "cpu_total_us": e.cpu_time_total} for e in ranked]  # fmt: skip


def sync_counts(averages) -> dict[str, int]:
    """Calls of the host-device synchronizations of SYNC_EVENTS, and device-to-host copies."""
    counts = dict.fromkeys((*SYNC_EVENTS, DTOH_COPY_PREFIX), 0)
    for event in averages:
        if event.key in counts:
            counts[event.key] += event.count
        elif event.key.startswith(DTOH_COPY_PREFIX):
            counts[DTOH_COPY_PREFIX] += event.count
    return counts


@contextmanager
def recording_sync_sites(sites: Counter):
    """CUDA: torch's sync debug mode ``warn`` for the block; every synchronizing operation it warns
    about is counted in ``sites`` by the Python line that made it (``file:line``)."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sites.update(f"{w.filename}:{w.lineno}" for w in caught if TORCH_SYNC_WARNING in str(w.message))


def profile_call(llm, recorder: StepRecorder, prompts: list, out_dir: Path, label: str, cuda: bool) -> dict:
    """One async call under torch.profiler: chrome trace, tables (appended), top ops, sync counts and,
    on CUDA, the Python lines of the synchronizing operations."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    sites: Counter = Counter()
    with profile(activities=activities) as prof, recording_sync_sites(sites) if cuda else nullcontext():
        call = timed_call(llm, recorder, prompts, "async")
    started = time.perf_counter()
    trace = out_dir / f"trace-{label}.json.gz"
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    keys = {name: key for name, key in SORT_KEYS.items() if cuda or name != "self_cuda"}
    tables = [f"== {label}: top {TOP_OPS} by {name} ==\n{averages.table(sort_by=key, row_limit=TOP_OPS)}\n"
              for name, key in keys.items()]  # fmt: skip
    with open(out_dir / "profile-tables.txt", "a") as f:
        f.write("\n".join(tables) + "\n")
    try:
        attribution = step_attribution(trace)
    except Exception as exc:  # an analysis of the trace: keep the profile without it
        attribution = {"error": repr(exc)}
    return {
        "call": call,
        "steps": len(model_steps(call)),
        "trace": str(trace),
        "trace_bytes": trace.stat().st_size,
        "sync_counts": sync_counts(averages),
        "sync_sites": [{"site": site, "count": n} for site, n in sites.most_common(TOP_SYNC_SITES)],
        "top": {name: top_ops(averages, key) for name, key in keys.items()},
        "attribution": attribution,
        "postprocess_s": time.perf_counter() - started,
    }


# ---------------------------------------------------------------------------------------------
# step attribution (from a chrome trace)


def load_trace_events(path: Path) -> list[dict]:
    """The complete ("X") events of a chrome trace, gzipped or not."""
    raw = Path(path).read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return [e for e in data.get("traceEvents", ()) if e.get("ph") == "X" and "dur" in e]


def end_us(event: dict) -> float:
    return event["ts"] + event["dur"]


def contains(outer: dict, inner: dict) -> bool:
    """``inner`` lies in ``outer``'s time on the same thread."""
    same_thread = (outer["pid"], outer["tid"]) == (inner["pid"], inner["tid"])
    slack = NESTING_SLACK_US
    return same_thread and outer["ts"] - slack <= inner["ts"] and end_us(inner) <= end_us(outer) + slack


def parent_indices(events: list[dict]) -> list[int | None]:
    """Per event, the index of the innermost other event of its thread that contains it (None: none)."""
    order = sorted(range(len(events)), key=lambda i: (str(events[i]["pid"]), str(events[i]["tid"]),
                                                      events[i]["ts"], -events[i]["dur"]))  # fmt: skip
    parents: list[int | None] = [None] * len(events)
    stack: list[int] = []  # the events containing the current one, innermost last
    for i in order:
        while stack and not contains(events[stack[-1]], events[i]):
            stack.pop()
        parents[i] = stack[-1] if stack else None
        stack.append(i)
    return parents


def per_step_by_name(events, steps: int, top: int) -> list[dict]:
    """The ``top`` names by total time: ms and calls per step."""
    totals: dict[str, list] = {}
    for e in events:
        total = totals.setdefault(e["name"], [0.0, 0])
        total[0] += e["dur"]
        total[1] += 1
    ranked = sorted(totals.items(), key=lambda item: item[1][0], reverse=True)[:top]
    return [{"name": name, "ms": round(us / 1e3 / steps, 3), "calls": round(n / steps, 2)} for name, (us, n) in ranked]


def device_attribution(events: list[dict], kept_ids: dict, kind_of: dict) -> dict[str, dict]:
    """Per step kind, the device windows of the kept steps (``gpu_user_annotation`` ranges of the
    step names, merged per External id: one per stream) and the kernels, copies and sets starting in
    them. Windows are matched to host steps with cores by External id; where no id matches (a trace
    without them), every window with device work counts."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    starts = [e["ts"] for e in device]
    windows: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("cat") == DEVICE_STEP_CATEGORY and e["name"] in kind_of:
            ext = e.get("args", {}).get("External id")
            windows.setdefault((kind_of[e["name"]], id(e) if ext is None else ext), []).append(e)
    by_id = any(ext in kept_ids for _, ext in windows)
    per_kind: dict[str, list] = {}
    for (kind, ext), group in windows.items():
        if by_id and ext not in kept_ids:
            continue
        start, end = min(e["ts"] for e in group), max(end_us(e) for e in group)
        inside = device[bisect_left(starts, start) : bisect_right(starts, end)]
        if inside:
            per_kind.setdefault(kind, []).append((end - start, inside))
    result = {}
    for kind, found in per_kind.items():
        n, work = len(found), [e for _, inside in found for e in inside]
        result[kind] = {"steps": n, "matched_by": "External id" if by_id else "device work",
                        "span_ms": round(sum(span for span, _ in found) / 1e3 / n, 3),
                        "busy_ms": round(sum(e["dur"] for e in work) / 1e3 / n, 3),
                        "top_kernels": per_step_by_name(work, n, TOP_KERNELS)}  # fmt: skip
    return result


def step_attribution(trace_path) -> dict:
    """Where the model steps' time goes, per step kind (``capture`` / ``plain``), from a chrome trace
    of :func:`profile_call` (gzipped or not); times are means per step, in ms.

    Host: the ``user_annotation`` step ranges with at least one recurrent core inside (an op of
    CORE_OPS on the same thread, fully contained, not inside another core; steps without one, the
    empty steps, are counted in ``skipped_steps``): the steps' duration (``host_ms``), the cores'
    (``core_ms``), the cores' direct children (an event inside a core and inside no other event
    there) in total (``children_ms``) and by name (``children``, top TOP_CHILDREN, ms and calls per
    step), the cores' time outside any child (``gaps_ms``: Python), and the first step's cores in
    order (``layer_core_ms``, one per recurrent layer). Device (CUDA traces): see
    :func:`device_attribution` (``span_ms``: window, ``busy_ms``: the sum of its device events)."""
    events = load_trace_events(trace_path)
    host = [e for e in events if e.get("cat") not in (*DEVICE_CATEGORIES, DEVICE_STEP_CATEGORY)]
    parents = parent_indices(host)
    kind_of = {STEP_RANGE.format(kind): kind for kind in STEP_KINDS}
    steps = {i: kind_of[e["name"]] for i, e in enumerate(host)
             if e.get("cat") == "user_annotation" and e["name"] in kind_of}  # fmt: skip
    cores_of: dict[int, list[int]] = {i: [] for i in steps}  # step -> its outermost cores, in time order
    for i in sorted((i for i, e in enumerate(host) if e["name"] in CORE_OPS), key=lambda i: host[i]["ts"]):
        j = parents[i]
        while j is not None and j not in steps and host[j]["name"] not in CORE_OPS:
            j = parents[j]
        if j in steps:
            cores_of[j].append(i)
    core_set = {c for cores in cores_of.values() for c in cores}
    children_of: dict[int, list[dict]] = {c: [] for c in core_set}
    for i, parent in enumerate(parents):
        if parent in core_set:
            children_of[parent].append(host[i])
    kinds, skipped, kept_ids = {}, {}, {}
    for kind in STEP_KINDS:
        of_kind = sorted((i for i, k in steps.items() if k == kind), key=lambda i: host[i]["ts"])
        kept = [i for i in of_kind if cores_of[i]]
        skipped[kind] = len(of_kind) - len(kept)
        if not kept:
            continue
        kept_ids.update((host[i].get("args", {}).get("External id"), kind) for i in kept)
        n, cores = len(kept), [c for i in kept for c in cores_of[i]]
        children = [e for c in cores for e in children_of[c]]
        core_us, children_us = sum(host[c]["dur"] for c in cores), sum(e["dur"] for e in children)
        kinds[kind] = {"steps": n, "host_ms": round(sum(host[i]["dur"] for i in kept) / 1e3 / n, 3),
                       "cores_per_step": round(len(cores) / n, 2), "core_ms": round(core_us / 1e3 / n, 3),
                       "children_ms": round(children_us / 1e3 / n, 3),
                       "gaps_ms": round((core_us - children_us) / 1e3 / n, 3),
                       "children": per_step_by_name(children, n, TOP_CHILDREN),
                       "layer_core_ms": [round(host[c]["dur"] / 1e3, 3) for c in cores_of[kept[0]]]}  # fmt: skip
    kept_ids.pop(None, None)
    for kind, device in device_attribution(events, kept_ids, kind_of).items():
        if kind in kinds:
            kinds[kind]["device"] = device
    return {"trace": str(trace_path), "core_ops": list(CORE_OPS), "kinds": kinds, "skipped_steps": skipped}


def attribution_lines(attribution: dict, top: int = 0) -> list[str]:
    """One line per step kind (host, cores, gaps, the busiest child; GPU span and busy when present)
    and, with ``top``, that many children and kernels and the per-layer cores under each."""
    if "error" in attribution:
        return [f"attribution failed: {attribution['error']}"]
    lines = []
    for kind, a in attribution["kinds"].items():
        line = (f"{kind} x{a['steps']}: host {a['host_ms']:.1f} ms/step, cores {a['core_ms']:.1f} ms "
                f"({a['cores_per_step']:g} per step; gaps {a['gaps_ms']:.1f} ms)")  # fmt: skip
        if a["children"]:
            line += f", top child {a['children'][0]['name']} {a['children'][0]['ms']:.1f} ms"
        if "device" in a:
            line += f"; GPU span {a['device']['span_ms']:.1f} ms, busy {a['device']['busy_ms']:.1f} ms"
        lines.append(line)
        if top:
            lines += [f"    {c['ms']:9.3f} ms {c['calls']:8g} calls  {c['name']}" for c in a["children"][:top]]
            lines.append("    layer cores ms: " + " ".join(f"{x:.2f}" for x in a["layer_core_ms"]))
            kernels = a.get("device", {}).get("top_kernels", [])[:top]
            lines += [f"    {k['ms']:9.3f} ms {k['calls']:8g} calls  GPU {k['name'][:100]}" for k in kernels]
    return lines or [f"no step with a recurrent core ({', '.join(CORE_OPS)})"]
