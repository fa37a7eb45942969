"""Reference pairs: pairs of runs of one prompt that differ by rounding only (cold vs second cold
control, stock's partial block-grid hits vs their cold controls, plugin vs stock cold controls, and
the producers under MTP or the decode-path controls where a restore's kernel path needs them): the
evidence :func:`bc_tools.bench.probes.calibrate` and :func:`bc_tools.bench.probes.calibrate_by_length`
turn into bounds. No pair contains a plugin restore.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bc_tools.bench.probes import Answer, ProbeRow


def reference_pairs(rows: Sequence[ProbeRow], stock_rows: Sequence[ProbeRow] = ()) -> list[tuple[Answer, Answer]]:
    """Pairs of runs of one prompt that differ by rounding only, from a plugin run and a stock run
    of the same scenario (same prompts, row by row):

    * cold vs second cold control, in both runs;
    * the stock run's partial block-grid hits (cached > 0) vs their cold controls;
    * the plugin run's cold controls vs the stock run's cold controls of the same continuation
      (where both producers answered alike, so the continuations are equal). The plugin stops
      every prefill at ``P - 1`` and stock on its block grid: these pairs carry the rounding of a
      prefill split off the grid, which a restore at an exact boundary adds too. On the CPU engine
      the first two kinds are bit-identical (grid splits are multiples of the GDN kernels' chunk
      and round like one long prefill), so without these the bound would be the bf16 floor.

    The producers (plugin vs stock) are left out: one such pair measured 0.74 on the CPU engine
    (P = 255, in-process batch), as large as a one-token state error, which would make the bound
    too loose to catch one (an open question: kernel path of a one-token step, or the P - 1 stop).
    """
    pairs = [(row.cold_again, row.cold) for row in (*rows, *stock_rows)]
    for row in stock_rows:
        pairs += [(run, cold) for _, run, cold in row.restored_pairs() if run.cached > 0]
    if stock_rows:
        for mine, stock in zip(rows, stock_rows, strict=True):
            if mine.prompt_len != stock.prompt_len:
                raise ValueError("plugin and stock rows must come from the same scenario, row by row")
            if mine.producer.tokens == stock.producer.tokens:
                pairs.append((mine.cold, stock.cold))
    return pairs


def mtp_reference_pairs(plugin: Sequence[ProbeRow], stock: Sequence[ProbeRow]) -> list[tuple[Answer, Answer]]:
    """:func:`reference_pairs` plus the plugin's and stock's producers of each prompt (MTP runs).

    Under MTP a restore at ``P - 1`` leaves one token, which vLLM runs as a padded speculative
    row (``scheduler.py:1131-1153``: the speculative GDN kernels), while its cold control ran it
    as a non-speculative row: a kernel-path difference that no pair of :func:`reference_pairs` has
    on the CPU engine (every one of them is bit-identical there, and stock makes no partial hit on
    prompts shorter than two blocks under MTP's block drop). The producers are two cold runs of
    one prompt on different kernel paths (the plugin stops at ``P - 1`` and runs the last token
    alone; stock prefills at once): rounding only, measured 0.07-0.26 on CPU. :func:`reference_pairs`
    leaves them out where they make the bound too loose to catch a one-token state error; under
    MTP the negative control in the same run (measured 1.44-1.47 on CPU) shows the bound still
    catches it."""
    return reference_pairs(plugin, stock) + [(a.producer, b.producer) for a, b in zip(plugin, stock, strict=True)]


def pairs_by_length(
    rows: Sequence[ProbeRow],
    stock_rows: Sequence[ProbeRow] = (),
    pairs: Callable[[Sequence[ProbeRow], Sequence[ProbeRow]], list[tuple[Answer, Answer]]] = reference_pairs,
) -> dict[int, list[tuple[Answer, Answer]]]:
    """``pairs(rows, stock_rows)`` (:func:`reference_pairs` by default) taken per prompt length,
    on the rows of that length of both runs, for :func:`calibrate_by_length`."""
    lengths = sorted({row.prompt_len for row in (*rows, *stock_rows)})
    return {
        n: pairs([r for r in rows if r.prompt_len == n], [r for r in stock_rows if r.prompt_len == n]) for n in lengths
    }


def decode_path_pairs(rows: Sequence[ProbeRow]) -> list[tuple[Answer, Answer]]:
    """Each continuation's decode-path control against its cold control, where that phase ran:
    two cold runs of one continuation whose only difference is the kernel path of
    ``[P - 1, committed)`` (one token per step, as the producer ran it, against one prefill). A
    restored continuation carries the producer's decode-kernel rounding, so these pairs are the
    like-with-like reference for its first token; no restore is in either run."""
    return [(row.cold_decoded, row.cold) for row in rows if row.cold_decoded is not None]
