"""Prompts that hit one cached prefix and reach the real CPU engine together start in fewer engine
steps under the plugin with ``shared_hits_together`` (``core/shared_hits.py``) than under stock
vLLM, which starts them a step apart.

The engines are ``benchmarks/same_step_arrivals.py``'s (one fresh process each), no speculative
decoding, eight prompts sent at once, each the whole blocks of a 700-token prefix and one token of
its own (a hit on the prefix then ends at the prompt's last hash-block boundary on any platform's
block layout: where vLLM defers). Checked: with the prefix cached first, stock takes a step or
more per prompt (the case exists) and the plugin fewer steps; every request caches exactly stock's
tokens; every first token's logprob differs from stock's by no more than stock's own first tokens
differ between the prefix cached first and computed beside them (the bound, calibrated here, at
least 0.001). Negative control: a corrupted release that also takes back the marks of states its
own step computes (``shared_hits_variants.ReleasingEveryMark``), with the prefix computed beside
the prompts, starts them on unwritten states, and their first tokens move past the bound.
"""

from __future__ import annotations

import pytest
from script_modules import load_script

pytestmark = pytest.mark.slow

PATTERN = [8]  # all eight prompts before the first engine step
SHARED = 700  # tokens of the primer's prefix; the prompts take its whole blocks (CPU: 512 of block 256)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from bc_tools.fixtures.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("shared_hits") / "tiny", family="qwen3_next")
    module = load_script("benchmarks/same_step_arrivals.py", "same_step_arrivals_shared_hits")

    def run(policy: str, primed: bool, variant: str | None = None):
        settings = {"shared_hits_together": True} if policy != "aligned" else {}
        result = module.run_engine(model, policy, 0, SHARED, [PATTERN], primed, settings, variant, own=0)
        return (*result["rows"][str(PATTERN)], result["engine"])

    out = {
        "stock": run("aligned", primed=True),
        "stock_beside": run("aligned", primed=False),
        "plugin": run("request_boundaries", primed=True),
        "corrupted": run("request_boundaries", primed=False, variant="shared_hits_variants:ReleasingEveryMark"),
    }
    print(out)
    return out


def deviations(ours: list[float], theirs: list[float]) -> list[float]:
    return [abs(a - b) for a, b in zip(ours, theirs, strict=True)]


NOISE_FLOOR = 1e-3  # a CPU's kernels may round a batch of eight rows apart from one row alone


def bound(runs) -> float:
    """The most stock's first-token logprobs move between the prefix cached first and computed
    beside (at least ``NOISE_FLOOR``; on the machine that wrote this test they did not move)."""
    return max(max(deviations(runs["stock"][2], runs["stock_beside"][2])), NOISE_FLOOR)


def test_the_plugin_starts_prompts_sharing_a_cached_prefix_in_fewer_steps(runs):
    (stock, stock_steps, _, engine), (plugin, plugin_steps, _, _) = runs["stock"], runs["plugin"]
    assert stock_steps >= len(stock), f"stock started them together: nothing to gain ({stock_steps} steps, {engine})"
    assert plugin_steps < stock_steps, (plugin_steps, stock_steps)
    assert plugin == stock and all(cached > 0 for cached in plugin), (plugin, stock)


def test_first_tokens_stay_within_stocks_own_spread(runs):
    assert max(deviations(runs["plugin"][2], runs["stock"][2])) <= bound(runs)


def test_negative_control_a_start_on_an_unwritten_state_moves_first_tokens_past_the_bound(runs):
    moved = deviations(runs["corrupted"][2], runs["stock_beside"][2])
    assert max(moved) > bound(runs), (moved, bound(runs))
