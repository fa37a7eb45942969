"""A restored next turn that runs past its restore point's block, on the real CPU engine.

vLLM stops a chunk that starts inside a block at that block's end, so a request restored at a
mid-block ``N`` took one more engine step than stock's request from the block grid below it. The
plugin lets that first chunk run on to vLLM's next stop, reading the restored block in place, and
leaves that slot uncached (``core/chunk_stops.py``, ``compat.leave_state_slot_uncached``). Checked here, on the tiny
Qwen3-Next (block 256) with the decode-path controls of ``test_decode_path_cpu`` and next turns
of two blocks and more (``new_tokens``), so every continuation crosses two block boundaries:

* the first chunk of every restored continuation runs past the block it starts in;
* the restored continuation is its decode-path control's state bit for bit at the first answer
  position, and its cached count is the committed boundary;
* a prompt sharing the continuation's first tokens up to the end of the restore block gets no
  hit there (the slot holding the restored state is not cached as that block's end state), and
  its first token is its cold control's bit for bit. The engine keeps a recurrent state at
  every block end (``prefix_cache_retention_interval`` of one block), where vLLM would cache that
  slot; its default keeps only a prompt's last one.

Negative controls: the same engine with the slot left to vLLM's caching (``slot_cached``) serves
that prompt the restored state as the state at the block's end, and its first token is then not
its cold control's (bit for bit: on this tiny model the ~200 tokens that state lacks move the
first token by 0.016-0.031 nats, as much as the chunk path's own rounding); and the corrupted
restore of ``corrupt_restore`` (one token off) is not its decode-path control's state.
"""

from __future__ import annotations

import pytest
from corrupt_restore import corrupted_pairs
from engine_script import engine_fixture

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, random, sys
sys.path.insert(0, sys.argv[2])  # tests/helpers/
import vllm.model_executor.layers.utils as layer_utils
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
layer_utils.check_cpu_sgl_kernel = lambda n, k, dtype: False  # as test_decode_path_cpu: batch-free rows
import boundary_checkpoints.core.kv_manager as kv_manager
from bc_tools.bench.probe_scenario import run_probes, top_logprobs
from corrupt_restore import CorruptScheduler
from decode_path_control import decode_path_class

llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=1024,
          enforce_eager=True, distributed_executor_backend="uni", enable_prefix_caching=True, seed=0,
          prefix_cache_retention_interval=256,  # a state at every block end (vLLM's default keeps fewer)
          additional_config={"boundary_checkpoints": {"policy": "request_boundaries", "prompt_capture": "in_step"}},
          scheduler_cls="decode_path_control.DecodePathScheduler")
block = llm.llm_engine.vllm_config.cache_config.block_size
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
first_chunks = {}  # request id -> (salt, prompt, chunk start, chunk end) of its first scheduled chunk
schedule = scheduler.schedule
def recording(*args, **kwargs):
    output = schedule(*args, **kwargs)
    for request_id, n in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        if request_id not in first_chunks:
            end = request.num_computed_tokens
            first_chunks[request_id] = (request.cache_salt, list(request.prompt_token_ids), end - n, end)
    return output
scheduler.schedule = recording
params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
vocab = llm.llm_engine.model_config.get_vocab_size()
keep_slot_uncached = kv_manager.leave_state_slot_uncached
out = {}
for run, seed in (("request_boundaries", 0), ("slot_cached", 2), ("corrupt", 1)):
    if run == "slot_cached":
        kv_manager.leave_state_slot_uncached = lambda managers, request_id, slot: None
    if run == "corrupt":
        kv_manager.leave_state_slot_uncached = keep_slot_uncached
        scheduler.__class__ = decode_path_class(CorruptScheduler)
    spans = scheduler.decode_spans
    before_spans, before_chunks = set(spans), set(first_chunks)
    rows = run_probes(llm, [40, 60, block + 44], 3, 16, seed=seed, decode_spans=spans,
                      new_tokens=2 * block + 44)
    committed = {r.prompt_len + len(r.producer.tokens) - 1 for r in rows}
    restored = [c for rid, c in first_chunks.items()
                if rid not in before_chunks and c[2] in committed and c[2] % block]
    rng = random.Random(seed)
    shares = []  # prompts sharing a restored continuation up to its restore block's end
    for salt, prompt, start, end in restored:
        shared = prompt[: (start // block + 1) * block] + [rng.randrange(4, vocab) for _ in range(20)]
        pair = [TokensPrompt(prompt_token_ids=shared, cache_salt=s) for s in (salt, salt + "-cold")]
        hit, cold = llm.generate(pair, params, use_tqdm=False)
        shares.append({"start": start, "block_end": (start // block + 1) * block, "cached": hit.num_cached_tokens,
                       "hit": top_logprobs(hit.outputs[0].logprobs), "cold": top_logprobs(cold.outputs[0].logprobs)})
    out[run] = {"block": block, "scheduler": type(scheduler).__name__, "rows": [r.as_dict() for r in rows],
                "restored_chunks": [[start, end] for _, _, start, end in restored], "shares": shares}
print("RESULT " + json.dumps(out))
"""

runs = engine_fixture(SCRIPT, runs=("request_boundaries", "slot_cached", "corrupt"), timeout=600)


def test_restored_first_chunks_run_past_their_block(runs):
    info, rows = runs
    block = info["request_boundaries"]["block"]
    chunks = info["request_boundaries"]["restored_chunks"]
    assert len(chunks) == len(rows["request_boundaries"])  # every continuation restored mid-block
    for start, end in chunks:
        assert end > (start // block + 1) * block, (start, end)


def test_a_restored_continuation_past_its_block_is_the_decode_path_state(runs):
    info, rows = runs
    for r in rows["request_boundaries"]:
        assert r.restored.cached == r.committed, r.prompt_len
        assert r.restored.logprobs[0] == r.cold_decoded.logprobs[0], r.prompt_len


def test_the_restored_state_s_slot_is_not_cached_as_its_block_end(runs):
    info, _ = runs
    shares = info["request_boundaries"]["shares"]
    assert shares
    for share in shares:
        assert share["cached"] < share["block_end"], share["start"]
        assert share["hit"][0] == share["cold"][0], share["start"]  # computed as its cold control


def test_negative_control_a_cached_slot_serves_the_restored_state_as_the_block_end(runs):
    info, _ = runs
    shares = info["slot_cached"]["shares"]
    assert shares
    for share in shares:
        assert share["cached"] == share["block_end"], share["start"]
        assert share["hit"][0] != share["cold"][0], share["start"]


def test_negative_control_a_restore_one_token_off_is_not_the_decode_path_state(runs):
    info, rows = runs
    block = info["corrupt"]["block"]
    corrupted = [r for r in rows["corrupt"] if "continuation" in corrupted_pairs(r.prompt_len, r.committed, block)]
    assert corrupted
    for r in corrupted:
        assert r.restored.logprobs[0] != r.cold_decoded.logprobs[0], r.prompt_len
