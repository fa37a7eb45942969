"""Where a prompt checkpoint is taken, and at which token count.

Contract
--------
Three ways, chosen once per engine from its configuration by :func:`decide`, a pure function of
:class:`EngineFacts` (:func:`decide_for` reads them from a ``VllmConfig``; the scheduler and the
worker both call it on the same configuration, so they agree without talking to each other):

* ``end`` (``prompt_capture`` ``auto``, the default, or ``end``): the state after all ``P``
  prompt tokens, copied from the request's blocks before the next step's forward, as a response
  checkpoint is: no split and no extra step, on any kernel and family, with or without speculative
  decoding. Under a drafter ``auto`` takes it where a GPU validated it
  (``support.PROMPT_END_SPECULATIVE``: Qwen3-Next under MTP and DFlash, Nemotron-H under MTP at
  k = 1) and stops elsewhere
  (:data:`SPECULATIVE_AUTO_REASON`). A next turn (a prompt
  that extends this one) restores it. A resend of the same prompt cannot (its last token must run
  to give logits) and gets vLLM's block-grid hit, but is itself
  captured at ``P - 1`` the way ``in_step`` would (``resend``: in step where the split applies,
  else by the stop; under speculative decoding always by the stop), so the sends after it restore
  all but the last token: only prompts seen twice pay. Under MTP the drafter's row ``P - 1`` is
  computed from token ``P``, the first sampled token, so the bundle serves only prompts whose token
  ``P`` is that one (the next-token guard, ``core/drafters.py``; the scheduler takes the token from
  the step's output). A pooled indexer under speculative decoding keeps every checkpoint on its
  pool grid (``docs/design.md`` contract 13), where ``P`` rarely is: the scheduler turns every
  mode into the stop there (:func:`on_pool_grid`).
* ``in_step`` (asked for by ``prompt_capture: in_step``): every prompt keeps ``P - 1``. The whole
  prompt is prefilled in one step; inside every Gated DeltaNet layer the last token of each prompt
  that is captured is split off (``worker/gdn_split.py``), so the state after ``P - 1`` is written
  to the checkpoint's block during the step that computes the prompt. It needs every one of: no
  speculative decoding (the split handles non-speculative rows only), no micro-batching (DBO), a
  model whose recurrent layers are all vLLM's plain ``QwenGatedDeltaNetAttention``
  (:data:`IN_STEP_ARCHITECTURES`), on CUDA a graph mode that runs prefill steps piecewise (not
  ``cudagraph_mode`` FULL, whose replay skips the layers' Python forward: the worker then stops
  rather than publish an unwritten checkpoint), and a GDN core the split knows: the CPU kernels
  (bit-exact, CI), or on CUDA the FLA Triton prefill kernel (``gdn_prefill_backend`` resolved to
  ``triton``; vLLM's Hopper default is FlashInfer's). On CUDA it carries a caveat
  (:data:`CUDA_IN_STEP_CAVEAT`, on the startup line): the split adds host work to every step that
  ends prompts.
* ``stop`` (``prompt_capture: stop``, ``auto`` under a drafter ``end`` is not validated with, or
  ``in_step`` where the split does not apply, with the first reason that applies): the prefill
  stops at ``P - 1``,
  the state is copied after that step and the last prompt token runs in one more engine step (the
  first-turn tax, ``docs/notes/first-turn-tax.md``).

Nothing here imports vLLM at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from boundary_checkpoints import support

AUTO = "auto"
IN_STEP = "in_step"
STOP = "stop"
END = "end"
OFF = "off"
PROMPT_CAPTURES = (AUTO, IN_STEP, STOP, END)
# What the startup line adds about in-step capture on CUDA (module docstring).
CUDA_IN_STEP_CAVEAT = (
    "CUDA: fresh-prompt TTFT is about stock's with 1 request in flight and about 1.15-1.2x stock's with 8 "
    "or more (the split's host work on host-bound prefill steps; the P - 1 stop is no cheaper)"
)

# vLLM 0.32 architectures whose every recurrent layer is a plain QwenGatedDeltaNetAttention
# (model_executor/models/qwen3_next.py and qwen3_5.py).
IN_STEP_ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


@dataclass(frozen=True)
class EngineFacts:
    """What the decision depends on, read from a ``VllmConfig`` (:func:`facts_of`)."""

    platform: str  # "cpu", "cuda", "rocm", or another platform's name
    gdn_prefill_backend: str | None  # vLLM's resolved GDN prefill kernel on CUDA, else None
    architectures: tuple[str, ...]
    speculative: bool
    micro_batching: bool
    speculative_method: str | None = None  # the drafter's method ("mtp", "dflash") when speculative
    speculative_k: int = 0  # the drafter's tokens per step (num_speculative_tokens) when speculative
    full_graphs_for_prefills: bool = False  # CUDA graph mode FULL: prefill steps replay whole graphs


@dataclass(frozen=True)
class PromptCaptureDecision:
    mode: str  # IN_STEP, STOP, END or OFF (no prompt checkpoints)
    reason: str = ""  # why STOP when in_step was asked for, or why OFF when they were on ("" otherwise)
    caveat: str = ""  # what is not validated about an IN_STEP decision ("" where nothing)
    resend: str = ""  # END: how a resend's P - 1 checkpoint is taken (IN_STEP or STOP, as under auto)

    @property
    def splits_in_step(self) -> bool:
        """Whether some prompts are captured by the GDN layers' split (the worker installs it)."""
        return IN_STEP in (self.mode, self.resend)

    def describe(self) -> str:
        """The phrase the scheduler's startup line uses for prompt checkpoints."""
        if self.mode == OFF:
            return f"off ({self.reason})" if self.reason else "off"
        if self.mode == END:
            how = "in step" if self.resend == IN_STEP else f"by the P - 1 stop: {self.reason}"
            return (
                "on (at the prompt's end P, copied after the step that computes it: no extra step, no split; "
                f"a prompt sent again keeps P - 1 ({how}) for the sends after it)"
            )
        if self.mode == IN_STEP:
            caveat = f"; {self.caveat}" if self.caveat else ""
            return f"on (captured inside the step that computes the prompt: no P - 1 stop{caveat})"
        return f"on (prefills stop at P - 1: {self.reason})"

    def startup_phrase(self, min_tokens: int = 0, next_token_guard: bool = False) -> str:
        """:meth:`describe` with the settings that narrow it, for the scheduler's startup line:
        ``min_tokens`` (``prompt_checkpoint_min_tokens``), ``next_token_guard`` (MTP: the
        drafter's row ``P - 1`` reads token ``P``)."""
        text = self.describe()
        if next_token_guard and self.mode == END:
            text += (
                "; under MTP a checkpoint at P serves only prompts whose token P is the first token sampled after it"
            )
        if min_tokens and self.mode != OFF:
            text += f", when the prompt's last step computes >= {min_tokens} tokens"
        return text


POOL_GRID_REASON = "speculative decoding with a pooled indexer keeps every checkpoint on its pool grid"
VLLM_POOL_GRID_REASON = (
    "vLLM's own cache keeps each prompt's state on the indexer's pool grid below P: its prefix match unit of "
    "{unit} tokens, in the prompt's last step where the kernels save a state inside the chunk and that step "
    "crosses a block boundary, else in a step vLLM splits off"
)
# Why ``auto`` stops at ``P - 1`` under a drafter where ``end`` is not validated on a GPU
# (:data:`boundary_checkpoints.support.PROMPT_END_SPECULATIVE` lists where it is).
SPECULATIVE_AUTO_REASON = (
    "speculative decoding with this drafter (the checkpoint at P, prompt_capture: end, is exact on the CPU engine; on "
    "a GPU it is validated under {validated})"
)


def end_validated_under_drafter(facts: EngineFacts) -> bool:
    """Whether ``auto`` takes the checkpoint at ``P`` under ``facts``' drafter: every architecture
    validated on a GPU with that method and at least as many drafts
    (:data:`~boundary_checkpoints.support.PROMPT_END_SPECULATIVE`)."""
    return support.validated_for_every_architecture(
        support.PROMPT_END_SPECULATIVE, facts.architectures, facts.speculative_method, facts.speculative_k
    )


def speculative_auto_reason() -> str:
    """:data:`SPECULATIVE_AUTO_REASON` naming the validated architecture and method pairs."""
    pairs = [
        f"{method} up to k = {k} on {arch}"
        for arch, methods in support.PROMPT_END_SPECULATIVE.items() for method, k in methods.items()
    ]  # fmt: skip
    return SPECULATIVE_AUTO_REASON.format(validated=", ".join(pairs))


def decide(prompt_checkpoints: bool, prompt_capture: str, facts: EngineFacts) -> PromptCaptureDecision:
    """How prompt checkpoints are taken for an engine with ``facts`` (module docstring)."""
    if not prompt_checkpoints:
        return PromptCaptureDecision(OFF)
    if prompt_capture == STOP:
        return PromptCaptureDecision(STOP, "prompt_capture is 'stop'")
    at_end_under_auto = not facts.speculative or end_validated_under_drafter(facts)
    if prompt_capture == END or (prompt_capture == AUTO and at_end_under_auto):
        resend = decide(True, IN_STEP, facts)
        return PromptCaptureDecision(END, resend.reason, resend.caveat, resend=resend.mode)
    if facts.speculative and prompt_capture == AUTO:
        return PromptCaptureDecision(STOP, speculative_auto_reason())
    if facts.speculative:
        return PromptCaptureDecision(STOP, "speculative decoding (the in-step split handles non-speculative rows only)")
    if facts.micro_batching:
        return PromptCaptureDecision(STOP, "micro-batching (DBO) splits the step's GDN metadata")
    if not facts.architectures or any(a not in IN_STEP_ARCHITECTURES for a in facts.architectures):
        return PromptCaptureDecision(
            STOP,
            f"model architecture {', '.join(facts.architectures) or '(none)'} has no plain Gated DeltaNet "
            "layers the in-step split knows",
        )
    if facts.platform == "cpu":
        return PromptCaptureDecision(IN_STEP)
    if facts.platform != "cuda":
        return PromptCaptureDecision(STOP, f"platform {facts.platform} (in-step capture knows CPU and CUDA kernels)")
    if facts.full_graphs_for_prefills:
        return PromptCaptureDecision(
            STOP,
            "cudagraph_mode FULL replays prefill steps from whole CUDA graphs, where the GDN layers' split "
            "does not run (FULL_AND_PIECEWISE, vLLM's default, runs them piecewise)",
        )
    if facts.gdn_prefill_backend != "triton":
        return PromptCaptureDecision(
            STOP,
            f"GDN prefill backend {facts.gdn_prefill_backend} (in-step capture knows the FLA Triton kernel: "
            "additional_config gdn_prefill_backend=triton)",
        )
    return PromptCaptureDecision(IN_STEP, caveat=CUDA_IN_STEP_CAVEAT)


def on_pool_grid(decision: PromptCaptureDecision, vllm_unit: int = 0) -> PromptCaptureDecision:
    """``decision`` for a pooled indexer under speculative decoding, where every checkpoint sits on
    the pool grid (``docs/design.md`` contract 13) and ``P`` rarely does: every prompt stops at a
    pool boundary below ``P - 1``. Its checkpoint is also what a next turn restores there, as no
    pool-grid snapshot is kept under speculative decoding and a response keeps a bundle only where
    it ends on the grid. ``vllm_unit``: vLLM's hash block, when vLLM itself keeps each prompt's
    recurrent state at its last hash-block boundary below the end and that unit is a multiple of
    the pool (``--prefix-match-unit``); then vLLM's cache holds that state on the grid, in the
    prompt's own step where the kernels save it inside the chunk, and the plugin takes none (its
    stop would add a step for a state vLLM keeps)."""
    if decision.mode == OFF:
        return decision
    if vllm_unit:
        return PromptCaptureDecision(OFF, VLLM_POOL_GRID_REASON.format(unit=vllm_unit))
    return PromptCaptureDecision(STOP, POOL_GRID_REASON)


def facts_of(vllm_config: Any) -> EngineFacts:
    """The :class:`EngineFacts` of a ``VllmConfig`` (vLLM's platform and GDN backend via compat)."""
    from boundary_checkpoints.compat import gdn_prefill_backend, mixed_batches_replay_full_graphs, platform_name

    platform = platform_name()
    model = getattr(vllm_config, "model_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    speculative = getattr(vllm_config, "speculative_config", None)
    return EngineFacts(
        platform=platform,
        gdn_prefill_backend=gdn_prefill_backend(vllm_config) if platform == "cuda" else None,
        architectures=tuple(getattr(model, "architectures", None) or ()),
        speculative=speculative is not None,
        speculative_method=getattr(speculative, "method", None),
        speculative_k=int(getattr(speculative, "num_speculative_tokens", None) or 0),
        micro_batching=bool(getattr(parallel, "use_ubatching", False)),
        full_graphs_for_prefills=platform == "cuda" and mixed_batches_replay_full_graphs(vllm_config),
    )


def decide_for(config: Any, vllm_config: Any) -> PromptCaptureDecision:
    """:func:`decide` for a ``BoundaryConfig`` on an engine's ``VllmConfig``."""
    return decide(config.prompt_checkpoints, config.prompt_capture, facts_of(vllm_config))
