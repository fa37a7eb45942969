"""vLLM's real scheduler over a synthetic hybrid KV layout, built and driven against the shadow worker.

:func:`build_scheduler` returns ``(scheduler, worker)``: the scheduler class vLLM would pick for
``policy`` (stock or the plugin's subclass) with its own KV cache manager, block pool and
coordinator, and a ``shadow_engine.ShadowWorker`` (or ``worker_cls``) modelling the same layout.
:func:`write_model_dir` writes the config-only model directory it is configured from,
:func:`make_request` and :func:`tokens` build requests of the synthetic vocabulary, and
:class:`Driver` runs the steps (``schedule``, the worker's ``execute``, ``update_from_output``),
optionally one step in flight. Nothing here checks KV contents: the worker raises
``shadow_engine.ShadowMismatch`` on a wrong read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from shadow_engine import ShadowWorker


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
    graph_fit_tokens: int | str = "auto",
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
                "graph_fit_tokens": graph_fit_tokens,
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

    def start_at_once(self, requests) -> tuple[list[int], list[list[int]]]:
        """Add ``requests`` together and step until every one finished: (prefill rows per step
        until all have started, their output tokens)."""
        for request in requests:
            self.scheduler.add_request(request)
        prefills_per_step: list[int] = []
        while sum(prefills_per_step) < len(requests):
            output = self.step()
            prefills_per_step.append(sum(1 for n in output.num_scheduled_tokens.values() if n > 1))
        return prefills_per_step, self.finish(requests)

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
