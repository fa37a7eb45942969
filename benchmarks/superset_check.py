"""Does the plugin keep every hit stock vLLM would give? Stock and plugin on the same traffic.

Contract
--------
Runs one multi-turn workload through vLLM's real scheduler and KV cache manager twice, over the
shadow runner of ``tests/helpers/shadow_engine.py`` (no model; deterministic), once stock (``aligned``)
and once with the plugin (``request_boundaries``), on a small pool (``--blocks`` blocks of 16
tokens) so that retention competes with vLLM's own cached blocks. ``--conversations``
conversations share a ``--system``-token prefix; each of ``--turns`` turns adds 20-120 user
tokens (``--user-tokens``); turns run one request at a time in a seeded order (so both schedulers
see the same requests in the same order and nothing depends on timing), each answering 8 tokens.
``--in-flight K`` keeps K requests running at once instead, the next one added as one finishes
(still deterministic: the same steps for the same scheduler decisions); ``--recurrent-groups``
sets the layout's recurrent KV groups (Qwen3-Next-80B's 24-layer cut has 3), ``--answer-tokens``
each answer's length (default 8), ``--together`` the plugin's ``shared_hits_together`` (default
``auto``: apart on a CPU; the GPU's default is together) and ``--async-scheduling`` vLLM's async
scheduler with one step in flight, as a GPU server runs. For each pool
size and seed it reports the cached tokens of both, their ratio, and the requests whose cached
tokens fell below stock's for the same request. ``--prompt-capture`` sets the plugin's
``prompt_capture`` (default ``auto``), ``--prompt-admission`` its ``prompt_admission`` (default
``auto``); the line also gives the plugin's capture copies, and the tokens requests got below
stock's hit for the same request beside the plugin's own estimate of them (``stock_tokens_lost``).
``--rounds R`` runs R rounds of new conversations on one engine (a warm pool after the first, as
the GPU benchmark's rounds on a server that stays up). ``--without-grid-blocks`` runs the plugin
with its bundles holding no block-grid hit (contract 7 of ``docs/design.md``): the comparison that
shows what those blocks are for; ``--always-yield`` runs it as if its hit balance were always
losing (``core/hit_balance.py``: bundles give way to every cached block, captures that would
evict one are refused), the comparison that tells a loss retention causes from one the changed
order of vLLM's free queue causes.

    .venv/bin/python benchmarks/superset_check.py --blocks 80,120,200,400 --seeds 6
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from shadow_scheduler import Driver, build_scheduler, make_request, tokens, write_model_dir  # noqa: E402


def conversation_order(rng: random.Random, args) -> list[int]:
    """Which conversation sends each request. Default: every conversation once per round, rounds
    in a seeded order. With ``--active A``: A conversations run at once, the next turn goes to a
    random one of them, each ends after 1 to 2 * ``--turns`` - 1 turns and the next conversation
    takes its place (traffic whose finished conversations stay in the cache)."""
    if not args.active:
        return [c for _ in range(args.turns) for c in rng.sample(range(args.conversations), args.conversations)]
    left = {c: rng.randint(1, 2 * args.turns - 1) for c in range(args.conversations)}
    active, waiting, order = list(range(args.active)), list(range(args.active, args.conversations)), []
    while active:
        conversation = rng.choice(active)
        order.append(conversation)
        left[conversation] -= 1
        if not left[conversation]:
            active.remove(conversation)
            if waiting:
                active.append(waiting.pop(0))
    return order


def cached_per_request(model_dir: Path, policy: str, seed: int, blocks: int, args) -> tuple[list[int], dict]:
    """Cached tokens of each request of the seeded workload's ``--rounds`` rounds on one engine, in
    the order they ran, and the plugin's counters (``capture_copies``, ``captures_yielded``,
    restores per round (``hits``) and the hit balance's ``stock_tokens_lost``; empty for stock)."""
    rng = random.Random(seed)
    scheduler, worker = build_scheduler(
        model_dir, policy=policy, num_blocks=blocks, max_retained_fraction=args.retained_fraction,
        max_num_batched_tokens=256, max_model_len=4096, prompt_capture=args.prompt_capture,
        num_recurrent_groups=args.recurrent_groups, max_num_seqs=max(8, args.in_flight),
        retention=args.retention, prompt_admission=args.prompt_admission, ring_kpool=args.ring_kpool,
        shared_hits_together={"true": True, "false": False}.get(args.together, args.together),
        async_scheduling=args.async_scheduling,
    )  # fmt: skip
    driver = Driver(scheduler, worker, lag=1 if args.async_scheduling else 0)
    store = getattr(scheduler, "checkpoint_store", None)
    cached: list[int] = []
    hits_per_round = []
    for _ in range(args.rounds):
        before = store.counters.hits if store is not None else 0
        cached += run_round(scheduler, driver, rng, args)
        hits_per_round.append(store.counters.hits - before if store is not None else 0)
    if store is None:
        return cached, {}
    names = ("capture_copies", "stock_tokens_lost", "captures_yielded")
    return cached, {name: getattr(store.counters, name) for name in names} | {"hits": hits_per_round}


def run_round(scheduler, driver, rng: random.Random, args) -> list[int]:
    """One round of the workload on the scheduler as it is: new conversations (a new prefix and
    new turns, as a GPU round's cache salt makes them), each request's cached tokens in order."""
    low, high = (int(n) for n in args.user_tokens.split(","))
    system = tokens(rng, args.system)
    history = {c: system + tokens(rng, rng.randint(low, high)) for c in range(args.conversations)}
    order = conversation_order(rng, args)
    cached = [0] * len(order)
    running: dict[int, tuple[int, object]] = {}  # conversation -> (its index in ``order``, request)
    next_index = 0
    for _ in range(10_000 * len(order)):  # ``Driver.finish``'s bound, per request
        if next_index == len(order) and not running:
            break
        while next_index < len(order) and len(running) < args.in_flight and order[next_index] not in running:
            request = make_request(history[order[next_index]], max_tokens=args.answer_tokens)
            scheduler.add_request(request)
            running[order[next_index]] = (next_index, request)
            next_index += 1
        driver.step()
        driver.drain()
        for conversation, (index, request) in list(running.items()):
            if request.is_finished():
                cached[index] = driver.cached_tokens.get(request.request_id, 0)
                answer = list(request.output_token_ids)
                history[conversation] = history[conversation] + answer + tokens(rng, rng.randint(low, high))
                del running[conversation]
    else:
        raise AssertionError("requests did not finish")
    return cached


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", default="80,120,200,400", help="pool sizes in 16-token blocks")
    parser.add_argument("--seeds", type=int, default=6, help="workloads per pool size (default 6)")
    parser.add_argument("--conversations", type=int, default=8, help="conversations (default 8)")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    parser.add_argument("--active", type=int, default=0, help="conversations at once (default 0: all, in rounds)")
    parser.add_argument("--system", type=int, default=40, help="tokens of the shared prefix (default 40)")
    parser.add_argument("--user-tokens", default="20,120", help="MIN,MAX tokens a turn adds (default 20,120)")
    parser.add_argument("--answer-tokens", type=int, default=8, help="tokens each answer has (default 8)")
    parser.add_argument(
        "--together",
        default="auto",
        choices=("auto", "true", "false"),
        help="the plugin's shared_hits_together (default auto: apart on a CPU)",
    )
    parser.add_argument("--async-scheduling", action="store_true", help="vLLM's async scheduler, one step in flight")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of new conversations on one engine (default 1)")
    parser.add_argument("--in-flight", type=int, default=1, help="requests running at once (default 1)")
    parser.add_argument("--recurrent-groups", type=int, default=2, help="recurrent KV groups (default 2)")
    parser.add_argument("--retained-fraction", type=float, default=0.25, help="max_retained_fraction (default 0.25)")
    parser.add_argument("--prompt-capture", default="auto", help="the plugin's prompt_capture (default auto)")
    parser.add_argument("--retention", default="borrow", help="the plugin's retention (default borrow)")
    parser.add_argument("--prompt-admission", default="auto", help="the plugin's prompt_admission (default auto)")
    parser.add_argument("--without-grid-blocks", action="store_true", help="bundles hold no block-grid hit")
    parser.add_argument("--always-yield", action="store_true", help="the hit balance always losing")
    parser.add_argument("--ring-kpool", type=int, default=None,
                        help="GLM-5.3-Flash's layout: an indexer tail ring on this pool grid (tokens)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write every request's cached tokens here (JSON)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.without_grid_blocks:
        from boundary_checkpoints.core.scheduler import BoundaryCheckpointMixin

        BoundaryCheckpointMixin._grid_blocks = lambda self, request, num_tokens, plan: ()
    if args.always_yield:
        from boundary_checkpoints.core.hit_balance import HitBalance

        HitBalance.losing = lambda self: True
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="bc-superset-")))
    rows = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        for seed in range(args.seeds):
            stock, _ = cached_per_request(model_dir, "aligned", seed, blocks, args)
            plugin, counters = cached_per_request(model_dir, "request_boundaries", seed, blocks, args)
            below = [i for i, (s, p) in enumerate(zip(stock, plugin, strict=True)) if p < s]
            size = len(stock) // args.rounds
            rounds = [(sum(stock[k : k + size]), sum(plugin[k : k + size])) for k in range(0, len(stock), size)]
            rows.append({
                "blocks": blocks, "seed": seed, "stock": stock, "plugin": plugin, "below": below,
                "copies": counters["capture_copies"], "estimated_lost": counters["stock_tokens_lost"],
                "hits": counters["hits"], "rounds": rounds,
            })  # fmt: skip
        subset = [r for r in rows if r["blocks"] == blocks]
        if args.rounds > 1:
            warm = [pair for r in subset for pair in r["rounds"][1:]]
            print(
                f"{blocks} blocks, rounds after the first: plugin / stock "
                f"{sum(p for _, p in warm) / sum(s for s, _ in warm):.3f}; rounds below stock "
                f"{sum(p < s for s, p in warm)} of {len(warm)}; restores per round "
                f"{[sum(r['hits'][k] for r in subset) for k in range(args.rounds)]}",
                flush=True,
            )
        stock_total = sum(sum(r["stock"]) for r in subset)
        plugin_total = sum(sum(r["plugin"]) for r in subset)
        rounds_below = sum(sum(r["plugin"]) < sum(r["stock"]) for r in subset)
        print(f"{blocks} blocks: cached tokens plugin / stock {plugin_total / stock_total:.3f} ({plugin_total} / "
              f"{stock_total}); workloads with fewer cached tokens than stock {rounds_below} of {len(subset)}; "
              f"requests below stock {sum(len(r['below']) for r in subset)} of {sum(len(r['stock']) for r in subset)}; "
              f"capture copies {sum(r['copies'] for r in subset)}; tokens below stock "
              f"{sum(max(s - p, 0) for r in subset for s, p in zip(r['stock'], r['plugin']))} "
              f"(the plugin's estimate: {sum(r['estimated_lost'] for r in subset)})",
              flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
