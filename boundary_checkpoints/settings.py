"""The plugin's settings: the ``"boundary_checkpoints"`` section of vLLM's ``additional_config``.

Contract
--------
* ``BoundaryConfig.from_additional_config(additional_config, env)`` reads the ``"boundary_checkpoints"``
  section of vLLM's ``additional_config`` (``--additional-config '{"boundary_checkpoints": {...}}'``).
  A missing section (or ``None``) gives the defaults. Anything else that is not exactly right (a section
  that is not a dict, an unknown key, a value of the wrong type, a number out of range, an unknown
  policy) raises ``BoundaryConfigError`` whose message names the offending key (for example
  ``boundary_checkpoints.policy``) and what is allowed. ``bool`` is never accepted as a number. A
  non-empty ``VLLM_BOUNDARY_CHECKPOINTS_POLICY`` environment variable overrides the policy and is
  validated the same way; a bad value is reported under the variable's name.
* ``BoundaryConfig.for_engine(vllm_config)`` is the same for an engine's ``VllmConfig``: the one
  place every process (plugin hook, scheduler, worker) parses its settings.

This module decides nothing (the policy gate is :mod:`boundary_checkpoints.gate`) and imports
nothing of vLLM or of the plugin's scheduler, worker or metrics.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from boundary_checkpoints.match_unit import MATCH_UNITS
from boundary_checkpoints.prompt_capture import PROMPT_CAPTURES

POLICIES = ("auto", "aligned", "request_boundaries")
CONFIG_KEY = "boundary_checkpoints"
ENV_POLICY = "VLLM_BOUNDARY_CHECKPOINTS_POLICY"


class BoundaryConfigError(ValueError):
    """Invalid plugin configuration, or ``request_boundaries`` asked for on an unsupported layout."""


# ---------------------------------------------------------------------------------------------------
# Field validation (shared by the dataclass and the parser)
# ---------------------------------------------------------------------------------------------------


def qualified(key: str) -> str:
    """``key`` as error messages name it: ``boundary_checkpoints.<key>``."""
    return f"{CONFIG_KEY}.{key}"


def _check_policy(value: Any, name: str) -> str:
    allowed = ", ".join(POLICIES)
    if not isinstance(value, str):
        raise BoundaryConfigError(f"{name} must be a string, one of: {allowed} (got {type(value).__name__} {value!r})")
    if value not in POLICIES:
        raise BoundaryConfigError(f"{name} must be one of: {allowed} (got {value!r})")
    return value


def _check_number(value: Any, name: str, range_text: str) -> float:
    # bool is an int subclass; True/False as a fraction or interval is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BoundaryConfigError(f"{name} must be a number {range_text} (got {type(value).__name__} {value!r})")
    number = float(value)
    if not math.isfinite(number):
        raise BoundaryConfigError(f"{name} must be a finite number {range_text} (got {value!r})")
    return number


def _check_fraction(value: Any, name: str) -> float:
    range_text = "in (0, 1]"
    number = _check_number(value, name, range_text)
    if not 0.0 < number <= 1.0:
        raise BoundaryConfigError(f"{name} must be a number {range_text} (got {value!r})")
    return number


def _check_interval(value: Any, name: str) -> float:
    range_text = ">= 0 (0 disables the stats log line)"
    number = _check_number(value, name, range_text)
    if number < 0.0:
        raise BoundaryConfigError(f"{name} must be a number {range_text} (got {value!r})")
    return number


def _check_token_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BoundaryConfigError(f"{name} must be an integer >= 0 (got {type(value).__name__} {value!r})")
    return value


CHAT_INSTRUCTION_BOUNDARIES = ("auto", "off")
PROMPT_ADMISSIONS = ("auto", "all")
RETENTIONS = ("hold", "borrow")


def _one_of(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    """A check that a value is one of ``choices`` (strings)."""

    def check(value: Any, name: str) -> str:
        if not isinstance(value, str) or value not in choices:
            allowed = ", ".join(choices)
            raise BoundaryConfigError(f"{name} must be one of: {allowed} (got {type(value).__name__} {value!r})")
        return value

    return check


def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BoundaryConfigError(f"{name} must be true or false (got {type(value).__name__} {value!r})")
    return value


def _check_auto_or_flag(value: Any, name: str) -> bool | str:
    if value != "auto" and not isinstance(value, bool):
        raise BoundaryConfigError(f'{name} must be "auto", true or false (got {type(value).__name__} {value!r})')
    return value


def _check_auto_or_token_count(value: Any, name: str) -> int | str:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise BoundaryConfigError(f'{name} must be "auto" or an integer >= 0 (got {type(value).__name__} {value!r})')
    return value


_FIELD_CHECKS = {
    "policy": _check_policy,
    "prompt_checkpoints": _check_flag,
    "prompt_checkpoint_min_tokens": _check_token_count,
    "prompt_admission": _one_of(PROMPT_ADMISSIONS),
    "prompt_capture": _one_of(PROMPT_CAPTURES),
    "max_retained_fraction": _check_fraction,
    "stats_log_interval_s": _check_interval,
    "chat_instruction_boundary": _one_of(CHAT_INSTRUCTION_BOUNDARIES),
    "retention": _one_of(RETENTIONS),
    "pool_grid_snapshots": _check_flag,
    "prefix_match_unit": _one_of(MATCH_UNITS),
    "shared_hits_together": _check_auto_or_flag,
    "graph_fit_tokens": _check_auto_or_token_count,
    "graph_ceiling_tokens": _check_auto_or_token_count,
}


# ---------------------------------------------------------------------------------------------------
# BoundaryConfig
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BoundaryConfig:
    """Validated plugin settings. Construction validates every field (numbers are stored as float)."""

    policy: str = "auto"
    max_retained_fraction: float = 0.25
    """Share of the KV block pool that retained checkpoints may hold, in (0, 1]."""
    stats_log_interval_s: float = 30.0
    """Seconds between periodic stats log lines, >= 0; 0 disables the line."""
    prompt_checkpoints: bool = True
    """Keep a checkpoint at the end of every prompt (``prompt_capture``), so that a next turn that
    extends the prompt restores all of it and a prompt sent again restores all but its last token.
    False: no prompt checkpoint; response checkpoints (the next turn of a conversation) are
    unaffected; a resend restores only from an older checkpoint or the stock block grid."""
    prompt_capture: str = "auto"
    """How the prompt checkpoint is taken (``prompt_capture.py``). ``auto`` (default) and ``end``:
    at ``P``, copied after the step that computes the prompt (no extra step, no split, any kernel
    and family); a resend of a prompt seen before keeps ``P - 1`` as ``in_step`` takes it, so only
    prompts sent twice pay. Under speculative decoding ``end`` does the same (MTP: guarded by the
    first sampled token; a resend keeps ``P - 1`` by the stop), and so does ``auto`` where a GPU
    validated it (Qwen3-Next under MTP), stopping at ``P - 1`` elsewhere; on a pooled indexer's
    pool grid (contract 13) every prompt stops on the grid. ``in_step``: every prompt keeps
    ``P - 1``, split off inside the Gated DeltaNet layers where the engine supports it (CPU, or
    CUDA with the FLA Triton GDN prefill kernel; Qwen3-Next / Qwen3.5; no speculative decoding),
    else by the stop; ``stop``: the prefill always stops at ``P - 1`` (one more engine step per
    prompt). The startup log line says which and why."""
    prompt_checkpoint_min_tokens: int = 0
    """With ``prompt_checkpoints``, take the prompt checkpoint (at ``P``, or at ``P - 1`` by the stop
    or in the step) only when the step that reaches it computes at least this many
    tokens (counted from where that step starts: the restore point of a short prompt, the last
    chunk boundary of a long one). A shorter tail is computed in one step either way, so a stop
    would add a step to this prompt to save a resend little: the resend then recomputes that tail
    (fewer than this many tokens) from the earlier checkpoint or cached block it starts from. 0
    (default): every prompt keeps one."""
    prompt_admission: str = "auto"
    """With ``prompt_checkpoints``, which prompts keep one (``core/admission.py``). ``auto``
    (default): every prompt while prompt checkpoints are seen used (a resend, a regenerate, a next
    turn that restores or would restore the prompt's checkpoint: at least 1 in 32 of the last 64
    prompts), else 1 prompt in 16 and every resend, so that traffic which reuses no prompt stops
    paying their copies, blocks and (where the prompt stops at ``P - 1``) steps; the first 64
    prompts keep one. ``all``: every prompt."""
    chat_instruction_boundary: str = "auto"
    """``auto``: the engine learns the chat template's block markers once at startup
    (``core/chat_markers.py``) and gives a request with no explicit instruction boundary the end of
    its leading system/developer block(s), when its prompt starts with one; the startup line says
    whether the markers were learned and why not. ``off``: only explicit values."""

    retention: str = "borrow"
    """How a retained checkpoint keeps its blocks. ``borrow`` (default): it holds only its private
    blocks (the last partial page, the states off the block grid) and borrows the rest from vLLM's
    prefix cache (its full pages, block-grid states), serving while vLLM keeps them; vLLM then
    evicts its cached blocks in the order it would without the plugin, and before vLLM hands out a
    cached block the least recently used checkpoint gives back its private blocks instead.
    ``hold``: it holds every block (and the block-grid states below it) until the budget or an
    allocation that does not fit evicts it (``docs/notes/retention.md``)."""
    pool_grid_snapshots: bool = True
    """Models with a pooled sparse-attention indexer (GLM-5.3-Flash), without speculative decoding:
    each decoding request keeps a copy of its recurrent state at its last indexer pool boundary
    (one block per recurrent group, from free blocks no cached page needs, all snapshots together
    at most ``max_retained_fraction`` of the pool, given back first under pressure), and its
    response checkpoint sits there, up to ``pool - 1`` tokens below the committed length. The next
    turn then prefills from the pool grid in one step instead of two. False: the response
    checkpoint sits at the committed length."""
    prefix_match_unit: str = "auto"
    """``auto`` (default): a pooled indexer under speculative decoding whose recurrent kernels save
    states inside the prefill chunk (GLM-5.3-Flash on FlashKDA) gets vLLM's prefix match unit set to
    the pool (16 tokens) where ``--prefix-match-unit`` is not given: vLLM then keeps each prompt's
    state on the pool grid: a prompt whose last step crosses a block boundary runs no extra step,
    others as many as with the plugin's stop (``match_unit.py``;
    the startup log says so). ``vllm``: vLLM's own unit (its default, the block, or the one given)."""

    shared_hits_together: bool | str = "auto"
    """True: prompts whose hits end on one cached recurrent state start in the same engine step
    (``core/shared_hits.py``), where vLLM starts them one step apart (two under async scheduling).
    It pays where a prefill step's time grows slower than its tokens (a GPU:
    ``docs/results/gpu-shared-hits-h100.md``) and loses median TTFT where it grows with them (the
    CPU engine: ``docs/results/cpu-shared-hits.md``). ``auto`` (default): true except on a CPU.
    False: vLLM's order. The startup log says which."""

    graph_fit_tokens: int | str = "auto"
    """A step of restored prompts that would cross this many tokens, beside the running requests,
    admits only those that fit, and the rest start in the next step, when they fit that one
    (``core/graph_fit.py``): two steps replayed from CUDA graphs instead of one run eagerly.
    ``auto`` (default): the largest CUDA graph vLLM replays for batches with prefills
    (``max_cudagraph_capture_size``; off where they run eagerly: a CPU, ``--enforce-eager``). 0:
    off. The startup log says which."""

    graph_ceiling_tokens: int | str = "auto"
    """The largest CUDA graph vLLM captures, where the user set no capture size
    (``max_cudagraph_capture_size`` / ``cudagraph_capture_sizes``) and vLLM's default is smaller
    (``graph_ceiling.py``): 8 restored next turns of about 100 tokens then replay one graph step
    instead of two. ``auto`` (default): 1,024 (vLLM's own default on Blackwell; 512 on Hopper).
    0: vLLM's. Not under speculative decoding. The startup log says when it raises it."""

    def __post_init__(self) -> None:
        for key, check in _FIELD_CHECKS.items():
            object.__setattr__(self, key, check(getattr(self, key), qualified(key)))

    @classmethod
    def from_additional_config(
        cls, additional_config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> BoundaryConfig:
        """Parse ``additional_config[CONFIG_KEY]``; a non-empty ``ENV_POLICY`` in ``env`` (default
        ``os.environ``) overrides the policy. Raises ``BoundaryConfigError`` naming the bad key."""
        section = _read_section(additional_config)
        allowed_keys = tuple(f.name for f in fields(cls))
        for key in section:
            if key not in allowed_keys:
                raise BoundaryConfigError(
                    f"{qualified(str(key))} is not a known key; allowed keys: {', '.join(allowed_keys)}"
                )
        values = dict(section)
        env_policy = (os.environ if env is None else env).get(ENV_POLICY)
        if env_policy:
            values["policy"] = _check_policy(env_policy, f"environment variable {ENV_POLICY}")
        return cls(**values)

    @classmethod
    def for_engine(cls, vllm_config: Any, env: Mapping[str, str] | None = None) -> BoundaryConfig:
        """The settings of the engine configured by ``vllm_config`` (a ``VllmConfig``-like object:
        its ``additional_config``, missing or ``None`` for the defaults); the plugin, the scheduler
        and the worker all read theirs here."""
        return cls.from_additional_config(getattr(vllm_config, "additional_config", None), env)


def _read_section(additional_config: Any) -> Mapping[str, Any]:
    if additional_config is None:
        return {}
    if not isinstance(additional_config, Mapping):
        raise BoundaryConfigError(
            f"additional_config must be a dict to hold the {CONFIG_KEY!r} section "
            f"(got {type(additional_config).__name__})"
        )
    section = additional_config.get(CONFIG_KEY)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise BoundaryConfigError(
            f"{CONFIG_KEY} must be a dict with keys "
            f"{', '.join(_FIELD_CHECKS)} (got {type(section).__name__} {section!r})"
        )
    return section
