"""End to end on the real OpenAI server (CPU engine, tiny Qwen3-Next): the default prompt
checkpoint at ``P``.

Per prompt (lengths off the 256-token block grid), one after the other: a cold producer; the prompt
plus one new token (a later turn whose history is not the answer) and its two cold controls under
fresh ``cache_salt`` values; then the same prompt sent a second and a third time. Three servers
run the same workload: the plugin with its defaults, the plugin with ``prompt_capture: stop``
(whose cold run of the extension stops its prefill at ``P``: the split a restore at ``P`` makes,
without a restore), and the plugin with the corrupted restore of ``corrupt_restore`` (the prompt
bundle's copies held back one engine step, so it holds the state after ``P + 1``) as the negative
control. Counts must be exact; first-token logprobs are judged by ``bench.probes``'s criteria with
bounds calibrated in this run from pairs that differ by rounding only: cold vs cold, and the
default's cold extension vs the stop server's (a prefill split at ``P``).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prompts import token_ids
from servers import BLOCK, corrupt_scheduler_args, tiny_server

from bc_tools.bench.client import complete
from bc_tools.bench.probe_scenario import TOP_LOGPROBS
from bc_tools.bench.probes import Answer, calibrate, state_failures

pytestmark = pytest.mark.slow

LENGTHS = (300, 420, 600, 700)  # P and P + 1 inside one block: the held-back copy sees the decode step
MAX_TOKENS = 8
RUNS = ("default", "stop", "corrupt")


def run_server(model_dir: Path, tmp_path_factory, run: str) -> list[dict[str, Answer]]:
    section = {"policy": "request_boundaries", **({"prompt_capture": "stop"} if run == "stop" else {})}
    config = {"boundary_checkpoints": section}
    extra_args, env = corrupt_scheduler_args() if run == "corrupt" else ([], {})
    rows = []
    with tiny_server(model_dir, tmp_path_factory, f"server_prompt_end_{run}", additional_config=config,
                     extra_args=extra_args, env=env) as server:  # fmt: skip

        def send(ids, salt) -> Answer:
            out = complete(server.base_url, ids, max_tokens=MAX_TOKENS, cache_salt=salt, logprobs=TOP_LOGPROBS,
                           return_tokens_as_token_ids=True)  # fmt: skip
            return Answer(out.cached_tokens, out.token_ids, out.top_logprobs)

        for index, length in enumerate(LENGTHS):
            rng = random.Random(index)
            prompt = token_ids(rng, length)
            row = {"producer": send(prompt, run)}
            extension = prompt + token_ids(rng, 1)
            row["extension"] = send(extension, run)
            row["cold"] = send(extension, f"{run}-cold-{index}")
            row["cold_again"] = send(extension, f"{run}-cold-again-{index}")
            row["second"] = send(prompt, run)
            row["third"] = send(prompt, run)
            rows.append(row)
    return rows


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    rows = {run: run_server(tiny_model_dir, tmp_path_factory, run) for run in RUNS}
    pairs = [(r["cold"], r["cold_again"]) for run in RUNS for r in rows[run]]
    pairs += [(mine["cold"], split["cold"]) for mine, split in zip(rows["default"], rows["stop"], strict=True)]
    return rows, calibrate(pairs)


def test_the_default_restores_p_for_a_later_turn_and_p_minus_1_from_the_third_send(results):
    rows, bounds = results
    for length, row in zip(LENGTHS, rows["default"], strict=True):
        assert row["producer"].cached == 0 and row["cold"].cached == 0, length
        assert row["extension"].cached == length, length
        second = row["second"].cached  # vLLM's block-grid hit, as stock gives
        assert second % BLOCK == 0 and second <= (length - 1) // BLOCK * BLOCK, length
        assert row["third"].cached == length - 1, length
        assert state_failures("extension", row["extension"], row["cold"], bounds) == [], bounds
        assert state_failures("third send", row["third"], row["producer"], bounds) == [], bounds


def test_the_stop_keeps_p_minus_1_from_the_second_send(results):
    rows, _ = results
    for length, row in zip(LENGTHS, rows["stop"], strict=True):
        assert row["extension"].cached == length - 1 and row["second"].cached == length - 1, length


def test_a_prompt_bundle_one_token_late_fails_the_same_criteria(results):
    """Negative control: the count is exact (``P``), so the state criteria must catch it."""
    rows, bounds = results
    caught = 0
    for length, row in zip(LENGTHS, rows["corrupt"], strict=True):
        assert row["extension"].cached == length, length
        caught += bool(state_failures("extension", row["extension"], row["cold"], bounds))
    assert caught == len(LENGTHS), bounds
