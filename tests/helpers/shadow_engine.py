"""A real vLLM scheduler driven step by step against a shadow model runner.

The scheduler, KV cache manager, block pool and coordinator are vLLM's own (with or without the
plugin's subclass). Only the model runner is replaced by :class:`ShadowWorker`, which mirrors what
vLLM's V1 runner (behind the plugin's worker) does with a ``SchedulerOutput`` in "align" mode --
apply the plugin's capture copies, zero new attention blocks, apply ``kv_cache_block_copies``, then
per request read the recurrent state from the block of the previous step (``(num_computed - 1) //
B`` for a new or resumed request), advance it through the scheduled tokens, write it into block
``ceil(end / B) - 1`` and write attention rows -- except that the "state" is a hash of the token
prefix. Every read is checked against the hash recomputed from the request's tokens, so any wrong
restore, missing copy, or block reused too early shows up as a :class:`ShadowMismatch`. Greedy
"sampling" is a function of the state, so a wrong state also changes the tokens.

In-step prompt captures (``prompt_capture: in_step``) are modelled like the plugin's GDN layers do
them: a request whose recurrent state block of this step is the source of a pair in
``boundary_in_step_captures`` gets the state after all but its step's last token written into the
pair's destination (a step of fewer than two tokens, or a pair no request takes, is a mismatch);
``boundary_post_forward_copies`` are applied after every request's forward.

``parallel_rows`` (on unless a test turns it off): a step's rows read their recurrent states as the
step found them (after its copies), as a GPU's rows run at once: a row that reads a state another
row of the same step writes sees the old one, so a hit admitted on a state computed in its own step
is a mismatch.

A "ring" group (the GLM indexer tail ring, block size = the pool size ``kpool``) holds, in the
request's one block, the tokens of the pool in progress. Like GLM's indexer, a step that starts off
the pool grid and completes the open pool must be a single (decode) token, which reads the ring; a
longer (prefill) step there never writes the pool's key. Such a step, or a step off the grid whose
ring does not hold exactly the tokens ``[start // kpool * kpool, start)``, is a mismatch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

MOD = (1 << 61) - 1
EMPTY_STATE = 7
ZERO = -1  # content of a freshly zeroed attention row


def advance(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 11) % MOD


def sample(state: int, vocab: int = 1000) -> int:
    return 4 + state % vocab


class ShadowMismatch(AssertionError):
    pass


@dataclass
class ShadowRequest:
    tokens: list[int]
    block_ids: list[list[int]]
    num_computed: int
    state_idx: int | None = None
    _prefix: list[int] = field(default_factory=lambda: [EMPTY_STATE])

    def prefix_state(self, length: int) -> int:
        """Hash state after ``tokens[:length]`` (cached; tokens only ever grow)."""
        while len(self._prefix) <= length:
            self._prefix.append(advance(self._prefix[-1], self.tokens[len(self._prefix) - 1]))
        return self._prefix[length]


@dataclass
class ShadowWorker:
    """Block contents keyed by block id: attention rows and recurrent states."""

    group_kinds: list[str]  # "attention" | "recurrent" | "ring" per KV cache group
    block_sizes: list[int]
    rows: dict[int, list[int]] = field(default_factory=dict)
    states: dict[int, int] = field(default_factory=dict)
    rings: dict[int, tuple[int, ...]] = field(default_factory=dict)
    requests: dict[str, ShadowRequest] = field(default_factory=dict)
    copies_applied: int = 0
    restored_reads: int = 0
    in_step_captures: int = 0
    in_step: dict[int, int] = field(default_factory=dict)  # this step's in-step capture pairs
    # Recurrent kernels that export a block-boundary state from inside a chunk (KDA, Mamba2):
    # (hash block, state block, alignment, cache-hit alignment) for vLLM's own placement rule.
    prefill_checkpoints: tuple[int, int, int, int] | None = None
    drop_eagle_block: bool = False  # vLLM's use_eagle_block_drop (MTP, DFlash), for that placement rule
    internal_checkpoints: int = 0  # such states written into a real (not the null) block
    parallel_rows: bool = True  # recurrent reads see the states at the step's start (module docstring)
    _step_states: dict[int, int] | None = None

    def execute(self, so):
        from vllm.v1.outputs import ModelRunnerOutput

        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids or ():
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = ShadowRequest(
                list(new.prompt_token_ids), [list(ids) for ids in new.block_ids], new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.requests[req_id] = ShadowRequest(
                    list(cached.all_token_ids[req_id]), [list(ids) for ids in new_ids], cached.num_computed_tokens[i]
                )
                continue
            req = self.requests[req_id]
            known = cached.all_token_ids.get(req_id)
            if known is not None and list(known) != req.tokens[: len(known)]:
                raise ShadowMismatch(f"{req_id}: scheduler and worker disagree on the tokens")
            if new_ids is not None:
                for group, ids in enumerate(new_ids):
                    req.block_ids[group].extend(ids)
            if req.num_computed != cached.num_computed_tokens[i]:
                raise ShadowMismatch(
                    f"{req_id}: worker computed {req.num_computed}, scheduler says {cached.num_computed_tokens[i]}"
                )
        # The plugin's worker applies capture copies before the runner zeroes and copies.
        for src, dst in getattr(so, "boundary_capture_copies", None) or ():
            self._copy(src, dst)
        for block_id in so.new_block_ids_to_zero or ():
            self.rows[block_id] = [ZERO] * max(self.block_sizes)
            self.rings.pop(block_id, None)
        for copy in so.kv_cache_block_copies or ():
            self._copy(copy.src_block_id, copy.dst_block_id)

        self.in_step = dict(getattr(so, "boundary_in_step_captures", None) or ())
        self._step_states = dict(self.states) if self.parallel_rows else None
        req_ids, sampled = [], []
        for req_id, num in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            sampled.append(self._forward(req_id, req, num))
            req_ids.append(req_id)
        if self.in_step:
            raise ShadowMismatch(f"in-step captures {self.in_step} taken by no request")
        for src, dst in getattr(so, "boundary_post_forward_copies", None) or ():
            self._copy(src, dst)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def _ring_step(self, req_id: str, req: ShadowRequest, group: int, start: int, end: int) -> None:
        kpool, [block] = self.block_sizes[group], req.block_ids[group]
        if start % kpool:
            if end - start > 1 and end >= start // kpool * kpool + kpool:
                raise ShadowMismatch(f"{req_id}: a {end - start}-token step from {start} completes the open pool")
            if self.rings.get(block) != tuple(req.tokens[start // kpool * kpool : start]):
                raise ShadowMismatch(f"{req_id}: ring group {group} at {start} is wrong")
        self.rings[block] = tuple(req.tokens[end // kpool * kpool : end])

    def _copy(self, src: int, dst: int) -> None:
        self.copies_applied += 1
        if src in self.rows:
            self.rows[dst] = list(self.rows[src])
        else:
            self.rows.pop(dst, None)
        if src in self.states:
            self.states[dst] = self.states[src]
        else:
            self.states.pop(dst, None)
        if src in self.rings:
            self.rings[dst] = self.rings[src]
        else:
            self.rings.pop(dst, None)

    def _internal_checkpoint(self, start: int, end: int, blocks: list[int]) -> tuple[int, int] | None:
        """``(position, block)``: where vLLM's worker writes the state after ``position`` tokens
        of the chunk ``[start, end)`` (``compute_mamba_prefill_checkpoints``, which knows no prefill
        end: into the null block, id 0, where the manager reserved none), or None."""
        if self.prefill_checkpoints is None:
            return None
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        hash_block, state_block, alignment, hit_alignment = self.prefill_checkpoints
        [offset], [col] = compute_mamba_prefill_checkpoints(
            [end], [end - start], hash_block_size=hash_block, mamba_block_size=state_block,
            checkpoint_alignment=alignment, drop_eagle_block=self.drop_eagle_block,
            cache_hit_alignment_tokens=hit_alignment,
        )  # fmt: skip
        if col < 0:
            return None
        block = blocks[col] if col < len(blocks) else 0
        self.internal_checkpoints += block != 0
        return start + offset, block

    def _forward(self, req_id: str, req: ShadowRequest, num: int) -> list[int]:
        start, end = req.num_computed, req.num_computed + num
        if end > len(req.tokens):
            raise ShadowMismatch(f"{req_id}: scheduled past its known tokens ({end} > {len(req.tokens)})")
        final_state = None
        previous_state_idx = req.state_idx
        for group, (kind, size) in enumerate(zip(self.group_kinds, self.block_sizes)):
            blocks = req.block_ids[group]
            if kind == "ring":
                self._ring_step(req_id, req, group, start, end)
            elif kind == "attention":
                for row in range(start):
                    got = self.rows.get(blocks[row // size], [])
                    value = got[row % size] if row % size < len(got) else None
                    if value != req.prefix_state(row + 1):
                        raise ShadowMismatch(f"{req_id}: attention group {group} row {row} is wrong")
                for row in range(start, end):
                    page = self.rows.setdefault(blocks[row // size], [ZERO] * size)
                    page[row % size] = req.prefix_state(row + 1)
            else:
                prev = previous_state_idx if previous_state_idx is not None else (start - 1) // size
                read = self.states if self._step_states is None else self._step_states
                state = EMPTY_STATE if start == 0 else read.get(blocks[prev])
                if start and previous_state_idx is None:
                    self.restored_reads += 1
                if state != req.prefix_state(start):
                    raise ShadowMismatch(f"{req_id}: recurrent group {group} state at {start} is wrong")
                current = -(-end // size) - 1
                destination = self.in_step.pop(blocks[current], None)
                internal = self._internal_checkpoint(start, end, blocks)
                for position, token in enumerate(req.tokens[start:end], start):
                    if internal is not None and position == internal[0]:
                        self.states[internal[1]] = state
                    if destination is not None and position == end - 1:
                        if end - start < 2:
                            raise ShadowMismatch(f"{req_id}: in-step capture of a {end - start}-token step")
                        self.states[destination] = state
                        self.in_step_captures += 1
                    state = advance(state, token)
                self.states[blocks[current]] = state
                req.state_idx = current
                final_state = state
        req.num_computed = end
        if end < len(req.tokens):
            return []  # a prefill chunk samples nothing
        token = sample(final_state)
        req.tokens.append(token)
        return [token]


def write_model_dir(path: Path, num_kv_heads: int = 2) -> Path:
    """A config-only hybrid model directory (no weights, no tokenizer) for VllmConfig.

    vLLM allows decode context parallelism up to ``tensor_parallel / num_kv_heads``: one KV head
    makes DCP 8 legal at TP 8."""
    from bc_tools.fixtures.tiny_models import qwen3_next_config

    path.mkdir(parents=True, exist_ok=True)
    if not (path / "config.json").exists():
        cfg = qwen3_next_config(
            num_attention_heads=8,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=8192,
            num_nextn_predict_layers=1,  # one MTP module: spec_shadow.py's speculative layouts
        )
        cfg.architectures = ["Qwen3NextForCausalLM"]
        cfg.save_pretrained(path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config))
    return path


def build_scheduler(
    model_dir: Path,
    *,
    policy: str = "request_boundaries",
    block_size: int = 16,
    num_blocks: int = 256,
    num_recurrent_groups: int = 2,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    async_scheduling: bool = False,
    max_retained_fraction: float = 0.5,
    prompt_checkpoints: bool = True,
    prompt_checkpoint_min_tokens: int = 0,
    prompt_capture: str = "in_step",
    retention: str = "borrow",
    prompt_admission: str = "auto",
    scheduler_reserve_full_isl: bool = True,
    dcp: int = 1,
    interleave: int = 1,
    kv_cache_groups: list | None = None,
    ring_kpool: int | None = None,
    ring_slots: int | None = None,
    num_speculative_tokens: int = 0,
    worker_cls: type | None = None,
    drafter: Path | None = None,
    prefill_checkpoint_alignment: int | None = None,
    pool_grid_snapshots: bool = True,
    shared_hits_together: bool | str = "auto",
    prefix_match_unit: int | None = None,
):
    """vLLM's real Scheduler (the class vLLM would pick for ``policy``) over a synthetic layout.

    ``scheduler_reserve_full_isl=False`` (vLLM's ``--no-scheduler-reserve-full-isl``) admits a
    request when its first chunk fits, so chunked prefills can run the pool dry and preempt.

    ``dcp > 1``: decode context parallelism at tensor parallel ``dcp`` (the model directory needs
    one KV head for 8), ``cp_kv_cache_interleave_size`` ``interleave``.

    ``num_speculative_tokens > 0``: MTP speculative decoding of that many tokens (one MTP module,
    so a prefill lookahead of 1); the recurrent groups keep that many speculative state blocks
    (align mode), and ``worker_cls`` (``spec_shadow.SpecShadowWorker``) runs the steps. The attention group's
    scheduler block is then a virtual page of ``block_size * dcp`` tokens (vLLM's manager
    multiplies the per-rank spec block by the DCP size); the recurrent groups, replicated on every
    rank, use that virtual page as their block so that align mode keeps one state per page. The
    shadow worker keeps one row per token of a virtual page: a whole-block copy on every rank
    moves every rank's rows of that page (``worker/geometry.py``), so a page is the unit it
    checks.

    ``drafter``: a DFlash drafter directory (``fixtures/dflash.py``): the speculative decoding of
    ``num_speculative_tokens`` tokens is DFlash with that drafter instead of MTP.

    ``kv_cache_groups``: a layout grouped by vLLM (``tests/core/test_family_layouts.py``) used instead of
    the synthetic one; the returned worker does not model it.

    ``prefill_checkpoint_alignment``: the recurrent groups export a block-boundary state from
    inside a chunk at that alignment, as KDA (GLM-5.3-Flash, Kimi-Linear) and Mamba2 (Nemotron-H)
    kernels do on the GPU (``MambaSpec.num_prefill_checkpoint_blocks``); the worker writes those
    states where vLLM's would.

    ``prefix_match_unit``: vLLM's ``--prefix-match-unit`` (the hash block; requests then need
    ``make_request(..., hash_block_size=prefix_match_unit)``).

    ``ring_kpool``: add a GLM indexer tail ring group of ``ring_slots`` slots (default: that pool
    size, the ring without speculation), after the other groups, and give the model config that
    ``index_kpool``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from boundary_checkpoints.core.scheduler import BoundaryAsyncScheduler, BoundaryScheduler

    vllm_config = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefix_match_unit=prefix_match_unit,
        tensor_parallel_size=dcp,
        decode_context_parallel_size=dcp,
        cp_kv_cache_interleave_size=interleave,
        distributed_executor_backend="mp" if dcp > 1 else None,
        speculative_config=(
            {
                "method": "dflash" if drafter else "mtp",
                "num_speculative_tokens": num_speculative_tokens,
                **({"model": str(drafter)} if drafter else {}),
            }
            if num_speculative_tokens
            else None
        ),  # fmt: skip
        additional_config={
            "boundary_checkpoints": {
                "policy": policy,
                "max_retained_fraction": max_retained_fraction,
                "prompt_checkpoints": prompt_checkpoints,
                "prompt_checkpoint_min_tokens": prompt_checkpoint_min_tokens,
                "prompt_capture": prompt_capture,
                "retention": retention,
                "prompt_admission": prompt_admission,
                "pool_grid_snapshots": pool_grid_snapshots,
                "shared_hits_together": shared_hits_together,
            }
        },
    ).create_engine_config()
    cache = vllm_config.cache_config
    page = block_size * dcp  # the scheduler's block (a virtual page under DCP)
    cache.block_size = block_size
    cache.mamba_block_size = page
    cache.num_gpu_blocks = num_blocks
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.scheduler_config.scheduler_reserve_full_isl = scheduler_reserve_full_isl
    dtype = torch.float32
    groups = [
        KVCacheGroupSpec(
            [f"attn.{0}"],
            FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=dtype),
        )
    ]
    for g in range(num_recurrent_groups):
        groups.append(
            KVCacheGroupSpec(
                [f"ssm.{g}"],
                MambaSpec(
                    block_size=page,
                    shapes=((1, 1),),
                    dtypes=(dtype,),
                    mamba_cache_mode="align",
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,  # Qwen3-Next's Gated DeltaNet
                    num_speculative_blocks=num_speculative_tokens,
                    num_prefill_checkpoint_blocks=int(prefill_checkpoint_alignment is not None),
                    prefill_checkpoint_alignment=prefill_checkpoint_alignment,
                ),  # fmt: skip
            )
        )
    kinds, sizes = ["attention"] + ["recurrent"] * num_recurrent_groups, [page] * (1 + num_recurrent_groups)
    if ring_kpool:
        slots = ring_slots or ring_kpool
        ring = CircularBufferSpec(block_size=slots, num_kv_heads=1, head_size=1, dtype=dtype, dcp_sharded=False)
        groups.append(KVCacheGroupSpec(["ring.0"], ring))
        kinds.append("ring")
        sizes.append(slots)
        vllm_config.model_config.hf_text_config.index_kpool = ring_kpool
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups or groups,
        prefix_cache_retention_interval=0,
    )  # fmt: skip
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if policy == "aligned":
        cls = AsyncScheduler if async_scheduling else Scheduler
    else:
        cls = BoundaryAsyncScheduler if async_scheduling else BoundaryScheduler
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
    )
    worker = (worker_cls or ShadowWorker)(kinds, sizes)
    if prefill_checkpoint_alignment is not None:
        hit_alignment = resolve_cache_hit_alignment_tokens(
            kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
        )
        worker.prefill_checkpoints = (hash_block_size, page, prefill_checkpoint_alignment, hit_alignment)
        speculative = vllm_config.speculative_config
        worker.drop_eagle_block = speculative is not None and speculative.use_eagle_block_drop()
    return scheduler, worker


def tokens(rng, n: int) -> list[int]:
    """``n`` random token ids of the synthetic vocabulary (ids 4..999), drawn from ``rng``."""
    return [rng.randrange(4, 1000) for _ in range(n)]


def free_blocks(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


_REQUEST_COUNTER = iter(range(10**9))


def make_request(
    prompt: list[int], *, max_tokens: int = 8, salt: str | None = None, stop_token_ids=None, hash_block_size: int = 16
):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=stop_token_ids is None, stop_token_ids=stop_token_ids)
    return Request(
        request_id=f"r{next(_REQUEST_COUNTER)}",
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )


@dataclass
class Driver:
    """Runs scheduler steps against the shadow worker; ``lag=1`` keeps one step in flight."""

    scheduler: object
    worker: ShadowWorker
    lag: int = 0
    in_flight: list = field(default_factory=list)
    cached_tokens: dict[str, int] = field(default_factory=dict)  # as vLLM reports it to clients

    def step(self):
        """One scheduler step run on the worker; returns its ``SchedulerOutput``."""
        output = self.scheduler.schedule()
        self.in_flight.append((output, self.worker.execute(output)))
        while len(self.in_flight) > self.lag:
            self._process(*self.in_flight.pop(0))
        return output

    def drain(self) -> None:
        while self.in_flight:
            self._process(*self.in_flight.pop(0))

    def _process(self, output, runner_output) -> None:
        for client_outputs in self.scheduler.update_from_output(output, runner_output).values():
            for out in client_outputs.outputs:
                if out.prefill_stats is not None:
                    self.cached_tokens[out.request_id] = out.prefill_stats.num_cached_tokens

    def run(self, requests, max_steps: int = 10_000) -> list[list[int]]:
        """Add ``requests``, step until every one finished, and return their output tokens."""
        for request in requests:
            self.scheduler.add_request(request)
        return self.finish(requests, max_steps)

    def finish(self, requests, max_steps: int = 10_000) -> list[list[int]]:
        """Step until every request (already added) finished; returns their output tokens."""
        for _ in range(max_steps):
            if all(r.is_finished() for r in requests):
                break
            self.step()
        else:
            raise AssertionError("requests did not finish")
        self.drain()
        return [list(r.output_token_ids) for r in requests]
