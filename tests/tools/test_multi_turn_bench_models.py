"""Tests of ``bc-bench`` with models: the model directories it writes (``--write-model``: real-size
configs and full-vocabulary tokenizers; ``--write-dflash-drafter``), and small runs against real CPU
servers of the tiny model (slow).

The end-to-end test launches the tiny Qwen3-Next twice at once (stock ``aligned`` and
``request_boundaries``) through ``--launch``: 2 rounds, N=2, T=2, S=64, U=16, A=8, one in flight;
the chat one (``--mode chat --turn1-only``) 1 round of 3 one-turn conversations sharing a system
message shorter than one block.
"""

from __future__ import annotations

import json

import pytest

from bc_tools.bench import cli, cli_args

# ------------------------------------------------------------------------------------------------
# model directories


@pytest.mark.parametrize("variant, architecture", [("dflash", "DFlashDraftModel"), ("dflash2", "DFlash2DraftModel")])
def test_write_dflash_drafter_sized_to_the_real_size_target(tmp_path, variant, architecture):
    from safetensors import safe_open

    target, drafter = tmp_path / "q24", tmp_path / "drafter"
    argv = ["--write-model", str(target), "--arch", "qwen3_next_80b_24l", "--write-dflash-drafter", str(drafter),
            "--dflash-variant", variant]  # fmt: skip
    assert cli.main(argv) == 0
    config = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["vocab_size"]) == (2048, 16, 2, 256, 151936)  # fmt: skip
    with safe_open(str(drafter / "model.safetensors"), "pt") as weights:
        assert weights.get_slice("layers.0.self_attn.q_proj.weight").get_shape() == [16 * 256, 2048]
    with pytest.raises(SystemExit):
        cli_args.parse_args(["--url", "http://x", "--label", "a", "--model", "m", "--write-dflash-drafter", "d"])


@pytest.mark.parametrize(
    "arch, architecture, vocab",
    [
        ("qwen3_next_80b_12l", "Qwen3NextForCausalLM", 151936),
        ("qwen3_next_80b_24l", "Qwen3NextForCausalLM", 151936),
        ("qwen3_next_80b_24l_mtp", "Qwen3NextForCausalLM", 151936),
        ("glm5_next_flash_dense", "Glm5NextForCausalLM", 154880),
        ("glm5_next_flash_dense_mtp", "Glm5NextForCausalLM", 154880),
        ("qwen35_9b", "Qwen3_5ForCausalLM", 248320),
    ],
)
def test_write_model_real_size_config_and_full_vocab_tokenizer(tmp_path, arch, architecture, vocab):
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / arch
    assert cli.main(["--write-model", str(out), "--arch", arch]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [architecture]
    assert cli.model_vocab_size(str(out)) == vocab
    if arch.startswith("glm5_next_flash_dense"):  # vLLM's own reader (transformers' has no text-only auto class)
        from vllm.transformers_utils.config import get_config

        config = get_config(str(out), trust_remote_code=False).get_text_config()
        assert config.num_nextn_predict_layers == (1 if arch.endswith("_mtp") else 0)
        raw = raw.get("text_config", raw)
        assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (4096, 45, vocab)
        assert config.layer_types.count("linear_attention") == 34
        assert set(config.mlp_layer_types) == {"dense"}
        assert (config.linear_num_heads, config.linear_head_dim, config.kv_lora_rank) == (64, 128, 512)
        assert (config.index_topk, config.index_kpool, config.num_attention_heads) == (2048, 16, 64)
        assert raw["mhc"] is False and raw["mla_use_nope"] is True
        return
    config = AutoConfig.from_pretrained(str(out))
    assert config.vocab_size == vocab
    if arch.startswith("qwen3_next_80b"):
        layers, experts = (12, 512) if arch == "qwen3_next_80b_12l" else (24, 64)
        assert raw.get("num_nextn_predict_layers", 0) == (1 if arch.endswith("_mtp") else 0)
        assert (config.hidden_size, config.num_hidden_layers) == (2048, layers)
        assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 2, 256)
        assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 32)
        dims = (config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim)
        assert dims == (128, 128, 4)
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (experts, 10, 512)
        assert config.shared_expert_intermediate_size == 512
    else:
        assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (4096, 32, 12288)
        assert config.layer_types.count("full_attention") == 8
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == vocab
    ids = [4, 5, vocab - 1, 1000, vocab // 2]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids


# ------------------------------------------------------------------------------------------------
# end to end: two real CPU servers of the tiny model, up at once, two interleaved rounds


@pytest.mark.slow
def test_end_to_end_two_rounds_on_cpu_servers(tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    argv = [
        "--launch", str(tiny_model_dir), "--repeat", "2", "--conversations", "2", "--turns", "2",
        "-S", "64", "-U", "16", "-A", "8", "--in-flight", "1",
        "--log-dir", str(tmp_path / "logs"), "--out-json", str(out_json),
        "--startup-timeout", "300", "--warmup", "0",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "cached-token ratio" in printed and "targets (" in printed
    result = json.loads(out_json.read_text())
    assert result["block_size"] == 256 and result["block_size_source"].startswith("server log")
    (level,) = result["levels"]
    assert [rd["order"] for rd in level["rounds"]] == [["aligned", "request_boundaries"],
                                                       ["request_boundaries", "aligned"]]  # fmt: skip
    records = result["records"]

    def conv(policy):
        return [r for r in records if r["policy"] == policy and r["phase"] == "conversation"]

    for policy in ("aligned", "request_boundaries"):
        rows = conv(policy)
        assert len(rows) == 2 * 2 * 2 and all(r["error"] is None for r in rows)
        assert all(r["cached_tokens"] is not None and r["ttft_s"] > 0 for r in rows)
        assert all(r["completion_tokens"] == 8 and len(r["answer_ids"]) == 8 for r in rows)
        assert all(r["prompt_tokens"] == 64 + 16 + (r["turn"] - 1) * 24 for r in rows)
    # stock hits only on the 256-token block grid: every prompt here is shorter than one block
    assert all(r["cached_tokens"] % 256 == 0 for r in conv("aligned"))
    # the plugin resumes exactly at the previous turn's committed length, in every round
    later = [r for r in conv("request_boundaries") if r["turn"] == 2]
    assert len(later) == 4 and all(r["cached_tokens"] == r["boundary"] == 64 + 16 + 8 - 1 for r in later)
    summ = level["summary"]
    hits = summ["policies"]["request_boundaries"]["exact_hits"]
    assert hits == {"median": 2, "p25": 2, "p75": 2, "n": 2}
    assert summ["policies"]["aligned"]["exact_hits"]["median"] == 0
    for key in ("ttft_all_p50_s", "ttft_turn1_p90_s", "ttft_cont_p99_s", "output_throughput_tok_s",
                "prefill_tokens", "cached_ratio"):  # fmt: skip
        s = summ["policies"]["request_boundaries"][key]
        assert s["n"] == 2 and s["p25"] <= s["median"] <= s["p75"]
    peak = summ["policies"]["request_boundaries"]["peak_bytes_retained"]
    assert peak["n"] == 2 and peak["median"] > 0
    added = summ["policies"]["request_boundaries"]["retained_bytes_added"]
    assert added["n"] == 2 and 0 < added["median"] <= peak["median"]
    assert summ["policies"]["aligned"]["peak_bytes_retained"]["n"] == 0
    ratio = summ["ratios"]["request_boundaries"]["turn1_ttft_vs_stock"]
    assert ratio["n"] == 2 and ratio["median"] > 0
    # floor: primed prefix L0 = one block is cached exactly, U + 1 tokens computed, in both rounds
    floor = [r for r in records if r["phase"] == "floor"]
    assert len(floor) == 4 and all(r["policy"] == "aligned" for r in floor)
    assert all(r["boundary"] == 256 and r["cached_tokens"] == 256 and r["prompt_tokens"] == 273 for r in floor)
    assert summ["floor"]["ttft_p50_s"]["n"] == 2
    servers = result["servers"]
    assert all(s["exit_codes"] and s["exit_codes"][0] is not None for s in servers.values())
    assert servers["request_boundaries"]["boundary_stats"]["hits"] >= 4


@pytest.mark.slow
def test_chat_shared_system_first_turns_on_cpu_servers(tiny_model_dir, tmp_path, capsys):
    """``--mode chat --turn1-only``: one-turn chat conversations sharing a system message shorter
    than one block (150 words + the template's 3 tokens < 256): the plugin restores the system
    block on every first turn after the first, stock caches nothing (its grid has no full block)."""
    out_json = tmp_path / "chat.json"
    argv = [
        "--launch", str(tiny_model_dir), "--mode", "chat", "--turn1-only", "--repeat", "1",
        "-N", "3", "-S", "150", "-U", "20", "-A", "4", "--in-flight", "1",
        "--log-dir", str(tmp_path / "logs"), "--out-json", str(out_json),
        "--startup-timeout", "300", "--warmup", "0",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["block_size"] == 256 and result["workload"]["mode"] == "chat"

    def firsts(policy):
        rows = [r for r in result["records"] if r["policy"] == policy and r["phase"] == "conversation"]
        assert len(rows) == 3 and all(r["turn"] == 1 and r["error"] is None for r in rows)
        return [r["cached_tokens"] for r in sorted(rows, key=lambda r: r["conversation"])]

    system_block = 150 + 3  # "<s> system" + 150 words + "</s>", one token each on the tiny tokenizer
    assert firsts("request_boundaries") == [0, system_block, system_block]
    assert firsts("aligned") == [0, 0, 0]
    summary = result["levels"][0]["summary"]
    assert summary["turn1_cached_median"] == {"aligned": 0, "request_boundaries": system_block}
    assert summary["lost_hits"]["request_boundaries"] == {"requests": 0, "tokens_lost": 0, "compared": 3}
    assert "turn-1 cached tokens: median per policy" in printed
    assert f"aligned 0, request_boundaries {system_block}" in printed
