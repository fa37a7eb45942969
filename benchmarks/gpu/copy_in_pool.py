"""The capture copy of one prompt on a KV cache laid out by vLLM itself, at serving pool sizes.

Contract
--------
Builds the KV cache specs of Qwen3-Next-80B dims cut to ``--layers`` layers (three Gated DeltaNet
layers per full-attention layer: GDN conv (3, 8192) bf16 + state (32, 128, 128) fp32; attention 2
KV heads of 256 bf16; hash block 1,056), lets vLLM 0.32 group them
(``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``) for ``--pool-gib`` GiB, allocates
the cache with vLLM's ``allocate_kv_cache`` on the device under each ``--layouts`` layout, and
builds the worker's ``PageCopier`` over the views, as the plugin's worker does. Prints the
copier's startup line, then times one prompt's capture (one pair per KV cache group: the
recurrent states and the attention tail page) with CUDA events around ``PageCopier.copy``:

* ``idle``: the device idle when the copy is issued (host work inside the events);
* ``busy``: the copy issued behind ``--busy-ms`` of device work (the host runs ahead, as in a
  serving step: device time only);
* ``near`` / ``far``: pairs of neighbouring blocks, or blocks spread over the whole pool;
* ``vllm_cow``: vLLM's ``copy_kv_cache_blocks_inplace`` over the same views, busy, far.

Median of ``--iters`` per cell, GB/s of the bytes the copier moves. ``--out``: the rows as JSON.
Question it answers: does a copy in a pool of serving size, laid out by vLLM, run at the kernel's
bandwidth (1.3-1.8 TB/s on 12 blocks, ``benchmarks/copy_kernel.py``)?
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

BLOCK = 1056


def qwen3_next_specs(layers: int) -> dict:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    specs = {}
    for i in range(layers):
        if i % 4 == 3:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
            )
        else:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                block_size=BLOCK, shapes=((3, 8192), (32, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align",
            )  # fmt: skip
    return specs


def allocate(layers: int, pool_gib: float, layout: str, device: torch.device):
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = layout
    register_all_kvcache_specs(vllm_config)
    groups = get_kv_cache_groups(vllm_config, qwen3_next_specs(layers))
    config = get_kv_cache_config_from_groups(vllm_config, groups, int(pool_gib * 2**30))
    caches = allocate_kv_cache(config, device, KVCacheLayout[layout], [BLOCK] * len(config.kv_cache_groups))
    return list(caches.values()), config.num_blocks, len(config.kv_cache_groups)


def timed(fn, iters: int, busy_ms: float, device: torch.device) -> float:
    """Median seconds of ``fn`` between two events, issued behind ``busy_ms`` of device work."""
    if device.type != "cuda":
        import time

        times = []
        for _ in range(iters):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if busy_ms:
            torch.cuda._sleep(int(busy_ms * 1.98e6))  # about 1.98 GHz clock cycles per ms on the H200
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def pairs_for(num_blocks: int, groups: int, spread: bool) -> list[tuple[int, int]]:
    if spread:
        step = num_blocks // (2 * groups)
        return [(g * step, num_blocks - 1 - g * step) for g in range(groups)]
    return [(2 * g, 2 * g + 1) for g in range(groups)]


def measure(layout: str, args: argparse.Namespace, device: torch.device) -> dict:
    """One layout's row: the copier's line and the timed cells (module contract)."""
    from boundary_checkpoints.compat import KVCacheBlockCopy, copy_kv_cache_blocks_inplace
    from boundary_checkpoints.worker.kernels import PageCopier

    caches, num_blocks, groups = allocate(args.layers, args.pool_gib, layout, device)
    copier = PageCopier(caches, num_blocks)
    copier.warm_up()
    page_bytes = sum(r.page_bytes for r in copier.kernel_regions + copier.torch_regions)
    row: dict = {"layout": layout, "num_blocks": num_blocks, "groups": groups, "copier": copier.describe()}
    print(f"{layout}: {num_blocks} blocks, {groups} groups; page copies: {row['copier']}", flush=True)
    for spread in (False, True):
        pairs = pairs_for(num_blocks, groups, spread)
        moved = page_bytes * len(pairs)
        for busy in (0.0, args.busy_ms):
            seconds = timed(lambda: copier.copy(pairs), args.iters, busy, device)  # noqa: B023
            key = f"{'far' if spread else 'near'}_{'busy' if busy else 'idle'}"
            row[key] = {"us": seconds * 1e6, "GBps": moved / seconds / 1e9, "bytes": moved}
    copies = [KVCacheBlockCopy(s, d) for s, d in pairs_for(num_blocks, groups, True)]
    seconds = timed(lambda: copy_kv_cache_blocks_inplace(caches, num_blocks, copies), args.iters, args.busy_ms, device)
    row["vllm_cow_far_busy"] = {"us": seconds * 1e6, "GBps": page_bytes * len(copies) / seconds / 1e9}
    print(json.dumps({k: v for k, v in row.items() if k != "copier"}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--pool-gib", type=float, default=60.0)
    parser.add_argument("--layouts", default="LBNHC,BLHNC")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for layout in args.layouts.split(","):
        rows.append(measure(layout, args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
        with open(args.out, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
