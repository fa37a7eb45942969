"""What a slot measures on its server besides the request records.

Contract: ``scrape_counters`` reads vLLM's ``SLOT_COUNTERS`` from a server's ``/metrics``
(preemptions; with speculative decoding, drafts and accepted tokens; the plugin's capture copies
and their time in microseconds, its own estimate of the prompt tokens it served beyond
stock's cache and short of it, the new prompts that waited for a prefix in flight, and the
allocations whose same-step mark on a shared hit it took back, and the requests that started a
step later to fit a CUDA graph), ``counter_deltas`` gives
their growth over a slot and ``slot_counters`` the slot's summary entries from it (with the mean
acceptance length, None without speculative decoding). ``flush_plugin_stats`` makes the engine log
one more plugin stats line, so that the log's peak ``bytes_retained`` covers the whole slot.
"""

from __future__ import annotations

import http.client
import re
import time
import urllib.request

from bc_tools.bench import stats
from bc_tools.bench.client import stream_complete
from bc_tools.bench.traffic import REQUEST_ERRORS, Target
from bc_tools.bench.workload import FIRST_RANDOM_ID

SLOT_COUNTERS = {  # summary key -> vLLM's Prometheus counter, read from /metrics around each slot
    "preemptions": "vllm:num_preemptions",
    "spec_drafts": "vllm:spec_decode_num_drafts",  # only with --speculative-config
    "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "capture_copies": "vllm:boundary_checkpoint_capture_copy_seconds_count",  # plugin, worker in-process
    "capture_copy_us": "vllm:boundary_checkpoint_capture_copy_seconds_sum",
    "tokens_beyond_stock": "vllm:boundary_checkpoint_tokens_beyond_stock",  # plugin, retention borrow
    "stock_tokens_lost": "vllm:boundary_checkpoint_stock_tokens_lost",
    "prompts_waited": "vllm:boundary_checkpoint_prompts_waited",  # plugin, speculative decoding
    "shared_hits_released": "vllm:boundary_checkpoint_shared_hits_released",  # plugin
    "rows_fit_to_graph": "vllm:boundary_checkpoint_rows_fit_to_graph",  # plugin, CUDA graphs
}
SCALES = {"capture_copy_us": 1_000_000}  # key -> factor from the series' unit (seconds) to the key's
PROMETHEUS_SAMPLE = re.compile(r"(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{.*\})?\s+(?P<value>\S+)")


def parse_counters(text: str, names: dict[str, str]) -> dict[str, int | None]:
    """Per key of ``names`` (key -> vLLM counter name, e.g. ``"vllm:num_preemptions"``): the
    counter's value in the Prometheus exposition ``text``, summed over its label sets (one per
    engine), or None when the text has no sample of it. A sample counts under its name with the
    ``_total`` suffix prometheus_client gives counters, or under the bare name; comments and
    other series (``_created``, ``..._per_pos_total``) do not."""
    wanted = {}
    for key, name in names.items():
        wanted[name] = wanted[f"{name}_total"] = key
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = PROMETHEUS_SAMPLE.match(line)
        if match and match["name"] in wanted:
            key = wanted[match["name"]]
            sums[key] = sums.get(key, 0.0) + float(match["value"])
    return {key: round(sums[key] * SCALES.get(key, 1)) if key in sums else None for key in names}


def scrape_counters(base_url: str, names: dict[str, str] = SLOT_COUNTERS) -> dict[str, int | None]:
    """``parse_counters`` of the server's ``/metrics``; every value None when the endpoint is
    missing."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException):
        text = ""
    return parse_counters(text, names)


def counter_deltas(before: dict[str, int | None], after: dict[str, int | None]) -> dict[str, int | None]:
    """Per key: how much the counter grew from ``before`` to ``after`` (None unless both are known)."""
    return {key: None if before.get(key) is None or value is None else value - before[key]
            for key, value in after.items()}  # fmt: skip


def slot_counters(deltas: dict[str, int | None]) -> dict[str, float | int | None]:
    """The slot's summary entries from its ``SLOT_COUNTERS`` deltas: ``preemptions``,
    ``spec_drafts``, ``spec_accepted_tokens`` and ``mean_acceptance_length`` (None without
    speculative decoding, see ``stats.acceptance_length``)."""
    return {
        **deltas,
        "mean_acceptance_length": stats.acceptance_length(
            deltas.get("spec_drafts"), deltas.get("spec_accepted_tokens")
        ),
    }


def flush_plugin_stats(target: Target, interval: float, salt: str) -> None:
    """Make the engine log one more stats line: wait out the interval, then send a tiny request
    (its own checkpoints are published after the line it triggers)."""
    time.sleep(interval + 0.3)
    try:
        stream_complete(target.base_url, [FIRST_RANDOM_ID] * 4, model=target.model, max_tokens=1,
                        cache_salt=f"{salt}-flush", timeout=60)  # fmt: skip
    except REQUEST_ERRORS:
        pass
    time.sleep(0.5)
