"""The planted DFlash / DFlash2 drafters (``fixtures/dflash.py``, ``planted_seed``) on CPU: draft
``j`` is ``succ^j`` of the bonus token for every token and ``j = 1 .. 3``.

vLLM runs DFlash on GPUs only, so one fresh process (``engine_script.run_engine_script``, with the
Triton stand-in and Model Runner V2 as in ``tests/tools/test_dflash_config.py``) builds vLLM's own
drafter classes on CPU, loads each fixture through the class's ``load_weights`` and runs the
draft step of ``v1/worker/gpu/spec_decode/dflash/speculator.py`` for a batch of requests, one per
bonus token: query rows ``[t, mask, mask, mask]`` at positions ``p .. p + 3`` after ``L`` context
rows whose K/V come from random target hidden states (``combine_hidden_states``, then the drafter's
``hidden_norm`` and each layer's K projection, K norm and RoPE, as ``precompute_and_store_context_kv``
does). The decoder layers, norms, DFlash2's convolutions, the LM head and DFlash2's candidate top-k
and selector scores are vLLM's modules; only the attention kernel is replaced by a plain softmax
over context and query rows (non-causal, or causal within the window, per layer). Draft ``j`` is
read at query row ``j`` (the arg-max of its logits; DFlash2: the greedy walk over its candidates).

Negative control: the random drafter of ``tests/gpu/test_gpu_dflash.py`` before this fixture, with the
planted target's embedding and LM head (vLLM shares them), drafts the successor at chance.

The GLM case of the GPU test (``glm5_next_mtp_planted``, seed 0: the same planted successor) is checked
the same way in a second process, behind ``family_weights.cpu_shims`` (vLLM inspects Glm5Next on CPU
only with them): its planted DFlash2 drafter (4 heads of 64 and 4 KV heads:
``fixtures.dflash.drafter_attention``) drafts ``succ^j``, the random drafter with GLM's embedding
and LM head at chance.
About 80 s (two vLLM imports, five small drafters).
"""

from __future__ import annotations

import json

import pytest
from engine_script import DRAFTER_SCRIPT_OPENING, HELPERS_DIR, run_engine_script

from bc_tools.fixtures import tiny_models as tm
from bc_tools.fixtures.dflash import MASK_TOKEN_ID, PLANTED_DRAFTS, write_dflash_drafter
from bc_tools.fixtures.qwen3_next_family import planted_successor

K = PLANTED_DRAFTS
SEED = 0
TARGET = "qwen3_next_mtp_planted"
DRAFTERS = {
    "dflash_planted": dict(variant="dflash", layer_types=("full_attention", "sliding_attention"), planted_seed=SEED),
    "dflash2_planted": dict(variant="dflash2", layer_types=("sliding_attention", "full_attention"), planted_seed=SEED),
    "dflash_random": dict(variant="dflash", layer_types=("full_attention", "sliding_attention")),
}
GLM_TARGET = "glm5_next_mtp_planted"  # the GPU GLM case's target: planted_successor(SEED) too
GLM_LAYERS = ("full_attention", "sliding_attention")  # the GPU GLM case's drafter
GLM_DRAFTERS = {
    "glm_dflash2_planted": dict(variant="dflash2", layer_types=GLM_LAYERS, planted_seed=SEED),
    "glm_dflash_random": dict(variant="dflash", layer_types=GLM_LAYERS),
}
WINDOW = 64
CONTEXTS = (70, 32000)  # bonus-token positions p: context rows at max(0, p - 70) .. p - 1
CONTEXT_ROWS = 70

SCRIPT = (
    DRAFTER_SCRIPT_OPENING
    + r"""
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.registry import ModelRegistry
from vllm.model_executor.models.qwen3_dflash2 import _score_edges
from vllm.utils.torch_utils import set_default_torch_dtype

target, drafters, k, mask_id = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
contexts, context_rows = json.loads(sys.argv[6]), int(sys.argv[7])
target_weights = load_file(os.path.join(target, "model.safetensors"))
tokens = torch.tensor([t for t in range(target_weights["lm_head.weight"].shape[0]) if t != mask_id])
B, R = len(tokens), k + 1


def reference_attention(attn, ctx_k, ctx_v, ctx_pos, query_pos):
    # The draft attention of one layer: each request's query rows attend to the context rows and
    # to the query rows, all of them (non-causal) or the earlier ones within the window (causal).
    heads, kv_heads, head = attn.num_heads, attn.num_kv_heads, attn.head_dim
    def forward(q, k_, v_):
        q = q.view(B, R, heads, head).float()
        keys = torch.cat([ctx_k.view(1, -1, kv_heads, head).expand(B, -1, -1, -1), k_.view(B, R, kv_heads, head)], 1)
        values = torch.cat([ctx_v.view(1, -1, kv_heads, head).expand(B, -1, -1, -1), v_.view(B, R, kv_heads, head)], 1)
        keys = keys.float().repeat_interleave(heads // kv_heads, 2)
        values = values.float().repeat_interleave(heads // kv_heads, 2)
        key_pos = torch.cat([ctx_pos, query_pos])
        allowed = torch.ones(R, len(key_pos), dtype=torch.bool)
        if attn.causal:
            allowed &= key_pos[None, :] <= query_pos[:, None]
        if attn.sliding_window is not None:
            allowed &= query_pos[:, None] - key_pos[None, :] < attn.sliding_window
        scores = torch.einsum("brhd,bshd->bhrs", q, keys) * attn.scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("bhrs,bshd->brhd", scores.softmax(-1), values)
        return out.reshape(B * R, heads * head).to(torch.bfloat16)
    return forward


def draft(model, p):
    generator = torch.Generator().manual_seed(p)
    ctx_pos = torch.arange(max(0, p - context_rows), p)
    query_pos = torch.arange(p, p + R)
    aux = torch.randn(len(ctx_pos), model.model.fc.input_size, generator=generator).to(torch.bfloat16)
    context = model.combine_hidden_states(aux)
    normed = model.model.hidden_norm(context)
    for layer in model.model.layers:
        attn = layer.self_attn
        qkv, _ = attn.qkv_proj(normed)
        _, ck, cv = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        ck = attn.k_norm(ck.reshape(-1, attn.num_kv_heads, attn.head_dim)).reshape(ck.shape)
        _, ck = attn.rotary_emb(ctx_pos, ck.clone(), ck.clone())
        attn.attn.forward = reference_attention(attn, ck, cv, ctx_pos, query_pos)
    ids = torch.full((B, R), mask_id)
    ids[:, 0] = tokens
    ids = ids.flatten()
    positions = query_pos.repeat(B)
    hidden, residual = model.model.embed_input_ids(ids), None
    for layer in model.model.layers:
        hidden, residual = layer(positions=positions, hidden_states=hidden, residual=residual)
    hidden, _ = model.model.norm(hidden, residual)
    rows = hidden.view(B, R, -1)[:, 1:].reshape(B * k, -1)  # draft j at query row j
    if not hasattr(model, "compute_candidates"):
        return model.compute_logits(rows).argmax(-1).view(B, k)
    candidates, unary = model.compute_candidates(rows)
    selector = model.model.candidate_selector
    top_k = selector.top_k
    scores = _score_edges(selector.predecessor_codebook, selector.successor_codebook, candidates.view(B, k, top_k),
                          unary.view(B, k, top_k), selector.hidden_projection(rows).view(B, k, -1), tokens, top_k)
    previous, out = torch.zeros(B, dtype=torch.long), []
    for step in range(k):  # the greedy walk of dflash2/speculator.py _selector_walk_kernel
        index = scores[torch.arange(B), step, previous].float().argmax(-1)
        out.append(candidates.view(B, k, top_k)[torch.arange(B), step, index])
        previous = index
    return torch.stack(out, 1)


out = {"tokens": tokens.tolist()}
for position, (name, drafter) in enumerate(sorted(drafters.items())):
    config = EngineArgs(model=target, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=40960,
                        enforce_eager=True,
                        speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": k},
                        ).create_engine_config()
    drafter_config = config.speculative_config.draft_model_config
    cls, _ = ModelRegistry.resolve_model_cls(drafter_config.architectures, model_config=drafter_config)
    with set_current_vllm_config(config), torch.inference_mode():
        if position == 0:
            init_distributed_environment(1, 0, DIST_INIT, 0, backend="gloo")
            initialize_model_parallel(1, 1)
        with set_default_torch_dtype(drafter_config.dtype):  # as vLLM's loader builds it
            model = cls(vllm_config=config, prefix="")
        for parameter in model.parameters():
            parameter.fill_(math.nan)
        model.load_weights(load_file(os.path.join(drafter, "model.safetensors")).items())
        own = [bool(getattr(model, flag, False)) for flag in ("has_own_embed_tokens", "has_own_lm_head")]
        if not any(own):  # vLLM shares the target's (v1/worker/gpu/spec_decode/dflash/utils.py)
            model.model.embed_tokens.weight.copy_(target_weights["model.embed_tokens.weight"])
            model.lm_head.weight.copy_(target_weights["lm_head.weight"])
        unwritten = sorted(n for n, p in model.named_parameters() if torch.isnan(p.float()).any().item())
        process_weights_after_loading(model, drafter_config, torch.device("cpu"))  # CPU GEMM setup, as the loader
        out[name] = {"own": own, "unwritten": unwritten, "drafts": {str(p): draft(model, p).tolist() for p in contexts}}
print("RESULT " + json.dumps(out))
"""
)


def run_drafts(root, family: str, drafters: dict, *flags: str) -> dict:
    """The SCRIPT's drafts of ``drafters`` next to the tiny ``family`` (seed ``SEED``) built in ``root``."""
    target = tm.make_tiny_model(root / "target", family=family, seed=SEED)
    paths = {name: write_dflash_drafter(root / name, target, window=WINDOW, **kw) for name, kw in drafters.items()}
    argv = (HELPERS_DIR, str(target), json.dumps({n: str(p) for n, p in paths.items()}), str(K), str(MASK_TOKEN_ID),
            json.dumps(CONTEXTS), str(CONTEXT_ROWS), *flags)  # fmt: skip
    info, _ = run_engine_script(SCRIPT, *argv, timeout=600)
    return info


@pytest.fixture(scope="module")
def drafted(tmp_path_factory) -> dict:
    return run_drafts(tmp_path_factory.mktemp("planted_dflash"), TARGET, DRAFTERS)


@pytest.fixture(scope="module")
def glm_drafted(tmp_path_factory) -> dict:
    return run_drafts(tmp_path_factory.mktemp("planted_glm_dflash"), GLM_TARGET, GLM_DRAFTERS, "--cpu-shims")


def successor_powers(tokens: list[int]) -> list[list[int]]:
    """``[succ(t), succ^2(t), ..., succ^K(t)]`` for each token."""
    successor = planted_successor(SEED).tolist()
    rows = []
    for token in tokens:
        row = []
        for _ in range(K):
            token = successor[token]
            row.append(token)
        rows.append(row)
    return rows


def check_successor_powers(run: dict, name: str) -> None:
    info = run[name]
    assert info["own"] == [True, True]  # its own embedding and LM head: vLLM keeps them
    assert info["unwritten"] == ["model.mask_embedding"]  # every tensor loaded (no mask_embedding.pt)
    expected = successor_powers(run["tokens"])
    for p, drafts in info["drafts"].items():
        wrong = [(t, d, e) for t, d, e in zip(run["tokens"], drafts, expected, strict=True) if d != e]
        assert not wrong, (p, len(wrong), wrong[:5])


def check_at_chance(run: dict, name: str) -> None:
    info = run[name]
    assert info["own"] == [False, False]
    expected = successor_powers(run["tokens"])
    for p, drafts in info["drafts"].items():
        hits = sum(d[0] == e[0] for d, e in zip(drafts, expected, strict=True))
        assert hits <= 0.02 * len(drafts), (p, hits)


@pytest.mark.parametrize("name", ["dflash_planted", "dflash2_planted"])
def test_planted_drafter_drafts_the_successor_powers(drafted, name):
    check_successor_powers(drafted, name)


def test_random_drafter_drafts_the_successor_at_chance(drafted):
    check_at_chance(drafted, "dflash_random")


def test_planted_glm_drafter_drafts_the_successor_powers(glm_drafted):
    """The GPU GLM case's drafter (DFlash2, full + sliding, 4 heads / 4 KV heads of 64) with GLM's
    target dims: every draft ``j`` is ``succ^j`` of the bonus token."""
    check_successor_powers(glm_drafted, "glm_dflash2_planted")


def test_random_drafter_on_glm_drafts_the_successor_at_chance(glm_drafted):
    """With the planted GLM target's embedding and LM head (shared by vLLM): at chance."""
    check_at_chance(glm_drafted, "glm_dflash_random")
