"""What the plugin's scheduler adds to an engine step: a decode-only step that captures and restores
nothing, (``--fresh``) a step that prefills fresh prompts, or (``--next-turns``) the steps that
start next turns sent at once.

Contract
--------
Builds vLLM's real scheduler and KV cache manager twice over the shadow runner of
``tests/helpers/shadow_engine.py`` (no model: the "forward" is a hash of the token prefix), once stock
(``policy: aligned``) and once with the plugin (``request_boundaries``), fills each with ``--running``
requests of ``--prompt-len`` tokens, runs them until every one decodes, and then times
``schedule()`` plus ``update_from_output()`` (host time, the runner's time excluded) over
``--steps`` decode-only steps. Rounds alternate the order (stock first, plugin first), ``--rounds``
of them; it prints per round the microseconds per step of each and the ratio, then the median
[p25..p75] of the ratios, and writes them to ``--out`` (JSON) if given.

``--fresh``: ``--prompts`` fresh prompts of ``--prompt-len`` tokens instead, ``--running`` at a
time (the next one arrives as one finishes), each answering ``--answer`` tokens, ``--block-size``
tokens per block and vLLM's default token budget of 8,192 per step; the time is per step that
prefills (the steps where each prompt ends and the plugin plans its checkpoint among them).

``--next-turns``: ``--running`` conversations of ``--prompt-len``-token prompts answer ``--answer``
tokens, then all send their next turn at once (the prompt, its answer and ``--user`` new tokens);
the time is per step from then until every next turn has its first token (the plugin restores
each response boundary there, stock its block grid), over ``--cycles`` such batches one after
another, and the next turns' cached tokens are printed per policy.

    .venv/bin/python benchmarks/scheduler_step_overhead.py --running 32 --steps 400 --rounds 6
    .venv/bin/python benchmarks/scheduler_step_overhead.py --fresh --running 8 --prompt-len 7900 \
        --block-size 1056 --prompts 16 --rounds 6
    .venv/bin/python benchmarks/scheduler_step_overhead.py --next-turns --running 8 --prompt-len 7900 \
        --answer 64 --user 100 --block-size 1056 --rounds 6 --cycles 8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from shadow_scheduler import build_scheduler, make_request, tokens, write_model_dir  # noqa: E402

from bc_tools.bench.stats import spread  # noqa: E402


def decode_step_us(model_dir: Path, policy: str, running: int, prompt_len: int, steps: int, seed: int) -> float:
    """Host microseconds per decode-only step of ``schedule()`` + ``update_from_output()``."""
    scheduler, worker = build_scheduler(
        model_dir, policy=policy, num_blocks=4096, max_num_seqs=running, max_num_batched_tokens=running * prompt_len,
        max_model_len=prompt_len + steps + 64,
    )  # fmt: skip
    rng = random.Random(seed)
    for _ in range(running):
        scheduler.add_request(make_request(tokens(rng, prompt_len), max_tokens=steps + 32))
    for _ in range(4):  # prefill, the first decode steps
        output = scheduler.schedule()
        scheduler.update_from_output(output, worker.execute(output))
    spent = 0.0
    for _ in range(steps):
        output, seconds = timed_step(scheduler, worker)
        spent += seconds
        assert output.total_num_scheduled_tokens == running, "a step that is not decode-only"
    return spent / steps * 1e6


def timed_step(scheduler, worker, cached: dict[str, int] | None = None):
    """(the step's ``SchedulerOutput``, host seconds of its ``schedule()`` + ``update_from_output()``);
    ``cached`` gets each request's cached tokens as vLLM reports them, once it has its first token."""
    start = time.perf_counter()
    output = scheduler.schedule()
    scheduled = time.perf_counter()
    result = worker.execute(output)
    ran = time.perf_counter()
    client_outputs = scheduler.update_from_output(output, result)
    seconds = (scheduled - start) + (time.perf_counter() - ran)
    if cached is not None:
        for outputs in client_outputs.values():
            cached.update({out.request_id: out.prefill_stats.num_cached_tokens
                           for out in outputs.outputs if out.prefill_stats is not None})  # fmt: skip
    return output, seconds


def prefill_step_us(
    model_dir: Path, policy: str, running: int, prompt_len: int, prompts: int, answer: int, block_size: int, seed: int
) -> float:
    """Host microseconds per step that prefills, ``prompts`` fresh prompts ``running`` at a time."""
    num_blocks = 2 * running * (prompt_len + answer) // block_size + 64  # no pressure
    scheduler, worker = build_scheduler(
        model_dir, policy=policy, block_size=block_size, num_blocks=num_blocks, max_num_seqs=running,
        max_num_batched_tokens=8192, max_model_len=prompt_len + answer, prompt_capture="auto",
    )  # fmt: skip
    rng = random.Random(seed)
    waiting = [make_request(tokens(rng, prompt_len), max_tokens=answer) for _ in range(prompts)]
    live: list = []
    spent, steps = 0.0, 0
    while waiting or live:
        while waiting and len(live) < running:
            live.append(waiting.pop(0))
            scheduler.add_request(live[-1])
        output, seconds = timed_step(scheduler, worker)
        if any(n > 1 for n in output.num_scheduled_tokens.values()):
            spent += seconds
            steps += 1
        live = [r for r in live if not r.is_finished()]
    return spent / steps * 1e6


def next_turn_step_us(
    model_dir: Path, policy: str, running: int, prompt_len: int, answer: int, user: int, block_size: int, seed: int,
    cycles: int = 1,
) -> tuple[float, int]:  # fmt: skip
    """(host microseconds per step that starts the next turns, their cached tokens in all), over
    ``cycles`` batches of conversations one after another on the same scheduler."""
    max_len = prompt_len + 2 * answer + user  # a pool of 8 conversations' worth per running one: no pressure
    scheduler, worker = build_scheduler(
        model_dir, policy=policy, block_size=block_size, num_blocks=8 * running * max_len // block_size + 64,
        max_num_seqs=running, max_num_batched_tokens=8192, max_model_len=max_len, prompt_capture="auto",
    )  # fmt: skip
    rng = random.Random(seed)
    spent, steps, cached, follow_ups = 0.0, 0, {}, []
    for _ in range(cycles):
        first = [make_request(tokens(rng, prompt_len), max_tokens=answer) for _ in range(running)]
        for request in first:
            scheduler.add_request(request)
        while not all(request.is_finished() for request in first):
            timed_step(scheduler, worker)
        batch = [make_request([*r.prompt_token_ids, *r.output_token_ids, *tokens(rng, user)], max_tokens=answer)
                 for r in first]  # fmt: skip
        for request in batch:
            scheduler.add_request(request)
        while not all(request.num_output_tokens > 0 for request in batch):
            spent += timed_step(scheduler, worker, cached)[1]
            steps += 1
        while not all(request.is_finished() for request in batch):
            timed_step(scheduler, worker)
        follow_ups += batch
    return spent / steps * 1e6, sum(cached[request.request_id] for request in follow_ups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, default=32, help="requests decoding in every step (default 32)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default 64)")
    parser.add_argument("--steps", type=int, default=400, help="timed decode steps per run (default 400)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, alternating the order (default 6)")
    parser.add_argument("--fresh", action="store_true", help="time the steps that prefill fresh prompts")
    parser.add_argument("--next-turns", action="store_true", help="time the steps that start next turns sent at once")
    parser.add_argument("--user", type=int, default=100, help="--next-turns: new tokens per next turn (default 100)")
    parser.add_argument("--cycles", type=int, default=5,
                        help="--next-turns: batches of conversations per run, one by one (default 5)")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=16, help="--fresh: prompts per run (default 16)")
    parser.add_argument("--answer", type=int, default=32, help="--fresh, --next-turns: answer tokens (default 32)")
    parser.add_argument("--block-size", type=int, default=1056,
                        help="--fresh, --next-turns: tokens per block (default 1056)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the rounds and the summary here (JSON)")
    args = parser.parse_args(argv)
    kind = "next-turn" if args.next_turns else "prefill" if args.fresh else "decode"
    cached: dict[str, int] = {}

    def step_us(policy: str, seed: int) -> float:
        if args.next_turns:
            us, cached[policy] = next_turn_step_us(model_dir, policy, args.running, args.prompt_len, args.answer,
                                                   args.user, args.block_size, seed, args.cycles)  # fmt: skip
            return us
        if args.fresh:
            return prefill_step_us(model_dir, policy, args.running, args.prompt_len, args.prompts, args.answer,
                                   args.block_size, seed)  # fmt: skip
        return decode_step_us(model_dir, policy, args.running, args.prompt_len, args.steps, seed)

    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="bc-sched-")))
    rounds = []
    for r in range(args.rounds):
        order = ("aligned", "request_boundaries") if r % 2 == 0 else ("request_boundaries", "aligned")
        times = {p: step_us(p, seed=r) for p in order}
        ratio = times["request_boundaries"] / times["aligned"]
        rounds.append({"order": list(order), "us_per_step": times, "ratio": ratio, **({"cached": dict(cached)}
                                                                                       if cached else {})})  # fmt: skip
        print(f"round {r} ({order[0]} first): stock {times['aligned']:.0f} us, plugin "
              f"{times['request_boundaries']:.0f} us per {kind} step, ratio {ratio:.3f}"
              + (f"; next turns cached {cached['aligned']} / {cached['request_boundaries']} tokens" if cached else ""),
              flush=True)  # fmt: skip
    ratio = spread([r["ratio"] for r in rounds])  # bc-bench's median [p25..p75]
    med, p25, p75 = ratio["median"], ratio["p25"], ratio["p75"]
    print(f"plugin / stock host time per {kind} step: {med:.3f} [{p25:.3f}..{p75:.3f}] over {len(rounds)} rounds "
          f"({args.running} running)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rounds": rounds,
                                        "ratio": {"median": med, "p25": p25, "p75": p75}}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
