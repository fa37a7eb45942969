"""What the plugin's scheduler adds to an engine step that captures and restores nothing.

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

    .venv/bin/python benchmarks/scheduler_step_overhead.py --running 32 --steps 400 --rounds 6
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

from shadow_engine import build_scheduler, make_request, tokens, write_model_dir  # noqa: E402

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
        start = time.perf_counter()
        output = scheduler.schedule()
        scheduled = time.perf_counter()
        result = worker.execute(output)
        ran = time.perf_counter()
        scheduler.update_from_output(output, result)
        spent += (scheduled - start) + (time.perf_counter() - ran)
        assert output.total_num_scheduled_tokens == running, "a step that is not decode-only"
    return spent / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, default=32, help="requests decoding in every step (default 32)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default 64)")
    parser.add_argument("--steps", type=int, default=400, help="timed decode steps per run (default 400)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, alternating the order (default 6)")
    parser.add_argument("--out", type=Path, help="write the rounds and the summary here (JSON)")
    args = parser.parse_args(argv)
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="bc-sched-")))
    rounds = []
    for r in range(args.rounds):
        order = ("aligned", "request_boundaries") if r % 2 == 0 else ("request_boundaries", "aligned")
        times = {p: decode_step_us(model_dir, p, args.running, args.prompt_len, args.steps, seed=r) for p in order}
        ratio = times["request_boundaries"] / times["aligned"]
        rounds.append({"order": list(order), "us_per_step": times, "ratio": ratio})
        print(f"round {r} ({order[0]} first): stock {times['aligned']:.0f} us, plugin "
              f"{times['request_boundaries']:.0f} us per decode step, ratio {ratio:.3f}", flush=True)  # fmt: skip
    ratio = spread([r["ratio"] for r in rounds])  # bc-bench's median [p25..p75]
    med, p25, p75 = ratio["median"], ratio["p25"], ratio["p75"]
    print(f"plugin / stock host time per decode step: {med:.3f} [{p25:.3f}..{p75:.3f}] over {len(rounds)} rounds "
          f"({args.running} running, {args.steps} steps)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rounds": rounds,
                                        "ratio": {"median": med, "p25": p25, "p75": p75}}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
