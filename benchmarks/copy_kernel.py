"""Kernel benchmark: bytes and time of one boundary snapshot (and restore) on real model geometries.

For each model (TP1, shapes from the public configs) the benchmark lays out the KV cache the way
vLLM 0.32 does for hybrids: one storage per layer slot, shared by one layer of every KV cache
group, each block one page of the unified page size (the attention page grown until it holds a
recurrent state). A snapshot copies one page per KV cache group (the recurrent state of every
recurrent group and the partial tail page of the attention group) in every storage; a restore
moves the same bytes the other way (the plugin's worker applies vLLM's copy-on-write pairs with the
same kernel, see ``worker/capture.py``). Timed with CUDA events, median of ``--iters`` runs after
warm-up, for three ways of moving the same bytes:

* ``plugin``: ``worker.kernels.PageCopier.copy`` as the worker runs it each step (block id upload
  plus one Triton launch), events around one call (host work included);
* ``vllm_cow``: vLLM's ``copy_kv_cache_blocks_inplace`` (what stock vLLM restores use);
* ``d2d``: one contiguous device-to-device ``copy_`` of the same number of bytes (the reference).

``*_b2b`` columns time ``--b2b`` calls back to back between one pair of events (per call), i.e.
the device time once the host runs ahead, as it does in a serving step. ``plugin_kernel`` is the
launches alone (pair codes prepared); ``plugin_host_us`` the host time of one
``PageCopier.copy`` call. ``sweep`` times kernel variants (tile size, warps, grid cap per
multiprocessor) the same way, round-robin ``SWEEP_ROUNDS`` times, median reported.

Run on the GPU host: ``python benchmarks/copy_kernel.py --out docs/results/gpu-copy-kernel.json``.
Target: plugin bandwidth >= 0.8 x d2d.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Geometry:
    name: str
    recurrent_layers: int
    attention_layers: int
    state_bytes: int  # one recurrent layer's state (conv + SSM) at TP1
    kv_bytes_per_token: int  # one attention layer
    note: str = ""

    @property
    def group_size(self) -> int:
        return self.attention_layers  # vLLM groups layers in runs of the smallest type count

    @property
    def recurrent_groups(self) -> int:
        return -(-self.recurrent_layers // self.group_size)

    @property
    def block_size(self) -> int:
        tokens = -(-self.state_bytes // self.kv_bytes_per_token)
        return -(-tokens // 16) * 16

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token


def gdn_state_bytes(v_heads: int, k_heads: int, head_dim: int, conv_kernel: int) -> int:
    ssm = v_heads * head_dim * head_dim * 4  # fp32 SSM state
    conv = (2 * k_heads * head_dim + v_heads * head_dim) * (conv_kernel - 1) * 2  # bf16
    return ssm + conv


GEOMETRIES = [
    Geometry("Qwen3-Next-80B-A3B", 36, 12, gdn_state_bytes(32, 16, 128, 4), 2 * 2 * 256 * 2),
    Geometry("Qwen3.5-35B-A3B", 30, 10, gdn_state_bytes(32, 16, 128, 4), 2 * 2 * 256 * 2),
    Geometry(
        "GLM-5.3-Flash",
        34,
        11,
        gdn_state_bytes(32, 32, 128, 4),
        512 * 2,
        note="KDA heads assumed 32 x 128 (Kimi-Linear-like; the public corpus lacks linear_attn_config); "
        "MLA NoPE latent 512 bf16 per token",
    ),
]


def median_ms(fn, iters: int, calls: int = 1) -> float:
    """Median milliseconds per call, ``calls`` calls between one pair of CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


# (tile words, warps, programs per multiprocessor or None for one program per tile)
SWEEP = [
    (4096, 8, None),
    (8192, 8, None),
    (8192, 16, None),
    (16384, 16, None),
    (4096, 8, 4),
    (4096, 8, 8),
    (8192, 8, 4),
    (8192, 16, 2),
]
SWEEP_ROUNDS = 3  # variants are timed round-robin this many times; the median is reported


def bench(geometry: Geometry, num_blocks: int, iters: int, b2b: int, sweep: bool = True) -> dict:
    from boundary_checkpoints.compat import KVCacheBlockCopy, copy_kv_cache_blocks_inplace
    from boundary_checkpoints.worker.kernels import PageCopier

    storages = [
        torch.empty(num_blocks, geometry.page_bytes, dtype=torch.uint8, device="cuda")
        for _ in range(geometry.group_size)
    ]
    for s in storages:
        s.random_(0, 256)
    groups = geometry.recurrent_groups + 1
    pairs = [(2 * g, 2 * g + 1) for g in range(groups)]  # one page per group
    nbytes = len(pairs) * len(storages) * geometry.page_bytes
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    copier = PageCopier(storages, num_blocks)  # built once per KV cache, as the worker does
    runs = {
        "plugin": lambda: copier.copy(pairs),
        "plugin_kernel": kernel_only(copier, pairs),
        "vllm_cow": lambda: copy_kv_cache_blocks_inplace(
            storages, num_blocks, [KVCacheBlockCopy(s, d) for s, d in pairs]
        ),
        "d2d": lambda: flat_dst.copy_(flat_src),
    }
    result = {
        **asdict(geometry),
        "block_size": geometry.block_size,
        "page_bytes": geometry.page_bytes,
        "storages": len(storages),
        "pages_per_snapshot": len(pairs),
        "bytes_per_snapshot": nbytes,
        "bytes_per_restore": nbytes,
    }
    for name, fn in runs.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        for suffix, calls in (("", 1), ("_b2b", b2b)):
            ms = median_ms(fn, iters, calls)
            result[f"{name}{suffix}_ms"] = ms
            result[f"{name}{suffix}_GBps"] = nbytes / ms / 1e6
    result["plugin_host_us"] = host_us(runs["plugin"], iters * b2b)
    for s in storages:  # the plugin copy must be exact
        torch.testing.assert_close(s[1], s[0], rtol=0, atol=0)
    for name in ("plugin", "plugin_kernel", "vllm_cow"):
        for suffix in ("", "_b2b"):
            result[f"{name}{suffix}_vs_d2d"] = result[f"{name}{suffix}_GBps"] / result[f"d2d{suffix}_GBps"]
    result["sweep"] = []
    if not sweep:
        return result
    variants = [
        kernel_only(PageCopier(storages, num_blocks, tile_words=t, num_warps=w, programs_per_sm=p), pairs)
        for t, w, p in SWEEP
    ]
    for fn in variants:
        fn()
    torch.cuda.synchronize()
    timings = [[] for _ in SWEEP]
    for _ in range(SWEEP_ROUNDS):
        for fn, times in zip(variants, timings):
            times.append(median_ms(fn, iters, b2b))
    result["sweep"] = [
        {
            "tile_words": t,
            "num_warps": w,
            "programs_per_sm": p,
            "kernel_b2b_GBps": nbytes / statistics.median(times) / 1e6,
            "kernel_b2b_vs_d2d": nbytes / statistics.median(times) / 1e6 / result["d2d_b2b_GBps"],
            "rounds_GBps": [nbytes / ms / 1e6 for ms in times],
        }
        for (t, w, p), times in zip(SWEEP, timings)
    ]
    return result


def kernel_only(copier, pairs):
    """The copier's launches alone, pair codes ready (the kernel without the host's per-call work)."""
    from boundary_checkpoints.worker.kernels import launch_arguments

    [(codes, num_pairs)] = launch_arguments(pairs)  # one launch per copier launch class
    launches = copier._launches  # benchmark-only look inside: time the launches alone
    return lambda: [launch(codes, num_pairs) for launch in launches]


def host_us(fn, calls: int) -> float:
    """Host microseconds per call while the device keeps up (no synchronisation inside)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=12)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--b2b", type=int, default=20, help="calls per timing in the back-to-back columns")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the kernel variant sweep")
    args = parser.parse_args()
    rows = [bench(g, args.num_blocks, args.iters, args.b2b, args.sweep) for g in GEOMETRIES]
    print(
        f"{'model':20} {'block':>5} {'MiB':>6} | one call GB/s: {'plugin':>7} {'CoW':>5} {'d2d':>6} {'ratio':>5} "
        f"| back-to-back GB/s: {'plugin':>7} {'kernel':>7} {'CoW':>5} {'d2d':>6} {'ratio':>5} {'kernel':>6} "
        f"| host us/call"
    )
    for r in rows:
        print(
            f"{r['name']:20} {r['block_size']:5d} {r['bytes_per_snapshot'] / 2**20:6.1f} | "
            f"{'':14} {r['plugin_GBps']:7.0f} {r['vllm_cow_GBps']:5.0f} {r['d2d_GBps']:6.0f} "
            f"{r['plugin_vs_d2d']:5.2f} | "
            f"{'':18} {r['plugin_b2b_GBps']:7.0f} {r['plugin_kernel_b2b_GBps']:7.0f} {r['vllm_cow_b2b_GBps']:5.0f} "
            f"{r['d2d_b2b_GBps']:6.0f} {r['plugin_b2b_vs_d2d']:5.2f} {r['plugin_kernel_b2b_vs_d2d']:6.2f} | "
            f"{r['plugin_host_us']:.0f}"
        )
        if r["sweep"]:
            print(
                "    kernel sweep (tile words/warps/programs per SM: back-to-back / d2d): "
                + ", ".join(
                    f"{v['tile_words']}/{v['num_warps']}/{v['programs_per_sm'] or '-'}: {v['kernel_b2b_vs_d2d']:.2f}"
                    for v in r["sweep"]
                )
            )
    if args.out:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": torch.cuda.get_device_name(0)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
