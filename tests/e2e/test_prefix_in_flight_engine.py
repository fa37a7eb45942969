"""Prompts that share a prefix and reach the real CPU engine together, under MTP k = 3 on the planted
fixture: the plugin lets a prompt wait for the prefix another request is computing
(``core/prefix_in_flight.py``), where stock vLLM runs it cold.

The arrivals and engines are ``benchmarks/same_step_arrivals.py``'s (one fresh process per
engine). Checked per arrival pattern: stock itself runs more than the first prompt cold (the case
exists: the control), the plugin caches at least stock's tokens for every request and more in
total, and every request has its first token within as many engine steps as under stock.
"""

from __future__ import annotations

import pytest
from script_modules import load_script

pytestmark = pytest.mark.slow

PATTERNS = [[2, 6], [8]]  # two prompts in the first step; all eight in it
SHARED = 700  # tokens of the shared prefix: the first prompt's state (256) is where the others read


def arrivals_module():
    return load_script("benchmarks/same_step_arrivals.py", "same_step_arrivals_under_test")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from bc_tools.fixtures.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("arrivals") / "mtp", family="qwen3_next_mtp_planted")
    module = arrivals_module()
    policies = ("aligned", "request_boundaries")
    runs = {policy: module.run_engine(model, policy, 3, SHARED, PATTERNS) for policy in policies}
    print(runs)
    return runs


@pytest.mark.parametrize("pattern", [str(p) for p in PATTERNS])
def test_a_prompt_arriving_beside_its_prefix_waits_for_it(engines, pattern):
    stock, stock_steps, _ = engines["aligned"]["rows"][pattern]
    plugin, plugin_steps, _ = engines["request_boundaries"]["rows"][pattern]
    assert stock.count(0) > 1, (
        f"stock ran only the first prompt cold: nothing to wait for ({stock}; {engines['aligned']['engine']})"
    )
    assert all(ours >= theirs for ours, theirs in zip(plugin, stock, strict=True)), (plugin, stock)
    assert sum(plugin) > sum(stock) and plugin.count(0) == 1, (plugin, stock)
    assert plugin_steps <= stock_steps, (plugin_steps, stock_steps)
