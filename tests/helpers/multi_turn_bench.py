"""Shared pieces of the ``bc-bench`` tests (``tests/tools/test_multi_turn_bench_*.py``): a small
seeded workload and the templates of the server log lines that ``bc_tools.bench.logs`` parses."""

from __future__ import annotations

from bc_tools.bench import workload as wl


def small_workload(**kw):
    """A 3-conversation, 4-turn token workload on a 1024-id vocabulary; ``kw`` overrides fields."""
    base = dict(conversations=3, turns=4, system_tokens=50, user_tokens=10, answer_tokens=6,
                concurrency=2, vocab_size=1024, seed=7)  # fmt: skip
    base.update(kw)
    return wl.Workload(**base)


# A plugin stats line (``{i}``: the hit count, ``{b}``: bytes retained) and vLLM's block-size line (``{n}``).
STATS_LINE = (
    "(EngineCore pid=12559) INFO 11-29 17:08:0{i} [scheduler.py:382] boundary_checkpoints: hits={i}, "
    "misses=1, tokens_restored=407, published=2, duplicates=0, evictions=0, captures_dropped=0, "
    "checkpoints_retained=2, blocks_retained=9, bytes_retained={b}, captures_pending=1"
)
BLOCK_LINE = (
    "(VllmWorker-0 pid=12627) INFO 11-29 17:07:53 [interface.py:1096] Setting attention block size to "
    "{n} tokens to ensure that attention page size is >= mamba page size."
)
