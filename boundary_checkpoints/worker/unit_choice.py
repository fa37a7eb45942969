"""The worker's side of the prefix match unit (``match_unit.py``): it sees the layers' KV cache specs.

Contract: :class:`MatchUnitWorkerMixin` extends vLLM's worker ``get_kv_cache_spec``. Once the
specs exist (the block size resolved, the kernels chosen) and before the engine core resolves its
hash block from the same config, it lets ``match_unit.apply`` set vLLM's prefix match unit and
logs the choice once. Where the engine core reads another copy of the config (an executor other
than ``uni``), it sets nothing: the scheduler then runs the pool-grid stop, as it says at startup.
"""

from __future__ import annotations

from vllm.logger import init_logger

from boundary_checkpoints import match_unit, support
from boundary_checkpoints.compat import engine_core_shares_worker_config, kv_spec_unit_facts
from boundary_checkpoints.core.boundaries import restore_tail
from boundary_checkpoints.settings import BoundaryConfig

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


class MatchUnitWorkerMixin:
    def get_kv_cache_spec(self):
        specs = super().get_kv_cache_spec()  # type: ignore[misc]
        config = self.vllm_config  # type: ignore[attr-defined]
        settings = BoundaryConfig.for_engine(config)
        pool = int(getattr(config.model_config.hf_text_config, "index_kpool", 0) or 0)
        if not pool or config.speculative_config is None or settings.prefix_match_unit != match_unit.AUTO:
            return specs  # no pooled indexer under a drafter, or vLLM's unit asked for: nothing to read
        facts = match_unit.UnitFacts(
            pool=pool,
            speculative=True,
            prefix_caching=bool(config.cache_config.enable_prefix_caching),
            **kv_spec_unit_facts(specs),
            shortest_prefill_row=restore_tail(config.speculative_config.num_speculative_tokens or 0),
            engine_reads_config=engine_core_shares_worker_config(config),
            validated=settings.policy == "request_boundaries"
            or support.lists_every_architecture(
                support.MATCH_UNIT_SPECULATIVE,
                config.model_config.architectures or [],
                config.speculative_config.method,
            ),
        )
        phrase = match_unit.apply(config.cache_config, settings.prefix_match_unit, facts)
        if phrase:
            logger.info("boundary_checkpoints: %s", phrase)
        return specs
