"""What the two property players share: ``property_stream.Stream`` (``test_property_scheduler.py``)
and ``spec_property_checks.SpecStream`` (``test_property_spec.py``, MTP) are both an
:class:`OperationPlayer`, which plays ``property_ops``' operations on vLLM's real scheduler through a
shadow driver, follows every request it adds as a :class:`Tracked` and checks their outputs and
cached tokens. An operation's handler returns the request it added, True for one that adds none,
False when it had nothing to do. A subclass builds the scheduler and its driver, applies and
finishes (with its own checks and ``Totals``), and says where the two players differ:
:attr:`~OperationPlayer.resends_under_other_salts` and :meth:`~OperationPlayer.admitted_max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prompts import common_prefix
from property_ops import (
    Abort,
    Branch,
    Continue,
    Fresh,
    Resend,
    Reset,
    Steps,
    pick_tracked,
    random_tokens,
    reference_output,
)
from shadow_scheduler import make_request

STEP_LIMIT = 3000  # steps to wait for requests to finish before calling the scheduler stuck


@dataclass
class Tracked:
    request: object
    prompt: list[int]
    salt: str | None
    expected: list[int]  # cold greedy output
    earlier_same_salt: list[object]  # requests of the same salt added before this one
    aborted: bool = False
    checked: bool = False  # its cached tokens were checked (vLLM reports them once)


def stop_ids(prompt: list[int], max_tokens: int, stop_at: int | None) -> tuple[int, ...]:
    """The stop token for a request that should stop at index ``stop_at`` of its cold output (its
    last token when the output is shorter; an earlier occurrence stops it sooner), none for None."""
    if stop_at is None:
        return ()
    plain = reference_output(prompt, max_tokens)
    return (plain[min(stop_at, len(plain) - 1)],)


class OperationPlayer:
    """One scheduler + shadow worker (``driver``) playing one example's operations."""

    resends_under_other_salts = True  # False: a Resend keeps the original's salt whatever its other_salt

    def __init__(self, driver, max_retained_fraction: float, max_prompt: int, totals) -> None:
        self.driver, self.scheduler, self.worker = driver, driver.scheduler, driver.worker
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.budget = int(self.pool.num_gpu_blocks * max_retained_fraction)
        self.free_before = self.pool.get_num_free_blocks()
        self.max_prompt = max_prompt  # a next turn longer than this is not sent
        self.tracked: list[Tracked] = []
        self.totals = totals

    def play(self, ops):
        """Applies every operation, finishes, and returns the totals."""
        for op in ops:
            self.apply(op)
        self.finish()
        return self.totals

    # -- operations --
    def handle(self, op) -> Tracked | bool:
        return getattr(self, f"_op_{type(op).__name__.lower()}")(op)

    def admitted_max_tokens(self, prompt: list[int], max_tokens: int) -> int | None:
        """The ``max_tokens`` to send ``prompt`` with, or None to send nothing."""
        return max_tokens

    def _add(self, prompt, salt, max_tokens, stop_at=None) -> Tracked | bool:
        admitted = self.admitted_max_tokens(prompt, max_tokens)
        if admitted is None:
            return False
        stops = stop_ids(prompt, admitted, stop_at)
        request = make_request(prompt, max_tokens=admitted, salt=salt, stop_token_ids=list(stops) or None)
        earlier = [t.request for t in self.tracked if t.salt == salt]
        tracked = Tracked(request, list(prompt), salt, reference_output(prompt, admitted, stops), earlier)
        self.tracked.append(tracked)
        self.scheduler.add_request(request)
        self.totals.requests += 1
        return tracked

    def _op_fresh(self, op: Fresh) -> Tracked | bool:
        return self._add(random_tokens(op.seed, op.length), op.salt, op.max_tokens, op.stop_at)

    def _op_resend(self, op: Resend) -> Tracked | bool:
        original = pick_tracked(self.tracked, op.which)
        if original is None:
            return False
        other = self.resends_under_other_salts and op.other_salt is not False
        return self._add(original.prompt, op.other_salt if other else original.salt, op.max_tokens)

    def _op_branch(self, op: Branch) -> Tracked | bool:
        original = pick_tracked(self.tracked, op.which)
        if original is None:
            return False
        return self._add(original.prompt[: op.keep] + random_tokens(op.seed, op.extra), original.salt, op.max_tokens)

    def _op_continue(self, op: Continue) -> Tracked | bool:
        previous = pick_tracked(self.tracked, op.which)
        if previous is None:
            return False
        self.step_until(previous.request.is_finished)  # the client waits for the last turn
        prompt = list(previous.request.all_token_ids) + random_tokens(op.seed, op.extra)
        if len(prompt) > self.max_prompt:
            return False
        return self._add(prompt, previous.salt, op.max_tokens, op.stop_at)

    def _op_abort(self, op: Abort) -> bool:
        from vllm.v1.request import RequestStatus

        live = [t for t in self.tracked if not t.request.is_finished()]
        if not live:
            return False
        victim = live[op.which % len(live)]
        victim.aborted = True
        self.scheduler.finish_requests([victim.request.request_id], RequestStatus.FINISHED_ABORTED)
        self.totals.aborts += 1
        return True

    def _op_steps(self, op: Steps) -> bool:
        for _ in range(op.k):
            self.step()
        return True

    def _op_reset(self, op: Reset) -> bool:
        assert self.scheduler.reset_prefix_cache(reset_running_requests=True), "vLLM's reset failed"
        assert len(self.scheduler.checkpoint_store) == 0 and not self.scheduler._pending
        self.totals.resets += 1
        return True

    def step(self) -> None:
        self.driver.step()
        self.totals.steps += 1

    def step_until(self, done) -> None:
        for _ in range(STEP_LIMIT):
            if done():
                return
            self.step()
        live = [(t.request.request_id, t.request.status) for t in self.tracked if not t.request.is_finished()]
        raise AssertionError(f"requests did not finish: {live}")

    # -- invariants --
    def check_requests(self) -> list[int]:
        """Every output equals (a prefix of, while it runs or when aborted) the cold output; the
        cached tokens vLLM reports for a request stay within the longest common prefix with an
        earlier request of the same salt, and ``P - 1``. Returns the cached counts checked now."""
        reported = []
        for t in self.tracked:
            rid = t.request.request_id
            out = list(t.request.output_token_ids)
            if t.request.is_finished() and not t.aborted:
                assert out == t.expected, f"{rid}: output {out} != cold output {t.expected}"
            else:
                assert out == t.expected[: len(out)], f"{rid}: output {out} diverges from cold output {t.expected}"
            if rid in self.driver.cached_tokens and not t.checked:
                t.checked = True
                cached = self.driver.cached_tokens[rid]
                bound = max([common_prefix(t.prompt, r.all_token_ids) for r in t.earlier_same_salt], default=0)
                bound = min(bound, len(t.prompt) - 1)
                assert 0 <= cached <= bound, (
                    f"{rid} (salt {t.salt!r}, prompt {len(t.prompt)}) reports {cached} cached tokens; "
                    f"longest same-salt common prefix allows {bound}"
                )
                reported.append(cached)
        return reported
