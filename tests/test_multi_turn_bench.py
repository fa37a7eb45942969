"""Tests of benchmarks/multi_turn.py: the pure parts, and one small run against real CPU servers.

The end-to-end test launches the tiny Qwen3-Next twice (stock ``aligned``, then
``request_boundaries``) through the benchmark's own ``--launch`` path: N=2, T=3, S=64, U=16, A=8, C=2.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_module():
    spec = importlib.util.spec_from_file_location("multi_turn_bench", ROOT / "benchmarks" / "multi_turn.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


mt = _load_module()


def _workload(**kw):
    base = dict(conversations=3, turns=4, system_tokens=50, user_tokens=10, answer_tokens=6,
                concurrency=2, vocab_size=1024, seed=7)  # fmt: skip
    base.update(kw)
    return mt.Workload(**base)


# ------------------------------------------------------------------------------------------------
# statistics


def test_percentile_linear_interpolation():
    assert mt.percentile([], 50) is None
    assert mt.percentile([None, None], 50) is None
    assert mt.percentile([3.0], 95) == 3.0
    assert mt.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert mt.percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert mt.percentile([1, 2, 3, 4], 0) == 1
    assert mt.percentile([1, 2, 3, 4], 100) == 4
    assert mt.percentile([10, None, 20], 50) == pytest.approx(15)
    with pytest.raises(ValueError):
        mt.percentile([1], 101)


def _rec(policy="p", phase="conversation", conv=0, turn=1, prompt=100, cached=0, completion=8,
         boundary=0, ttft=0.1, start=0.0, end=1.0, answer=(), error=None):  # fmt: skip
    return mt.RequestRecord(policy=policy, phase=phase, conversation=conv, turn=turn, prompt_tokens=prompt,
                            cached_tokens=cached, completion_tokens=completion, boundary=boundary,
                            ttft_s=ttft, latency_s=end - start, start_s=start, end_s=end,
                            answer_ids=list(answer), error=error)  # fmt: skip


def test_summarize_policy_ratios_throughput_and_exact_hits():
    records = [
        _rec(turn=1, prompt=100, cached=0, ttft=0.4, start=0.0, end=1.0),
        _rec(turn=2, prompt=120, cached=107, boundary=107, ttft=0.1, start=1.0, end=2.0),
        _rec(turn=3, prompt=140, cached=128, boundary=127, ttft=0.3, start=2.0, end=4.0),
        _rec(phase="floor", turn=2, prompt=273, cached=256, boundary=256, ttft=9.0),
        _rec(phase="warmup", turn=1, prompt=999, cached=0, ttft=9.0, start=-5, end=-4),
        _rec(turn=3, conv=1, error="HTTP 500", start=0.0, end=0.5),
    ]
    s = mt.summarize_policy(records)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["prompt_tokens"] == 360 and s["cached_tokens"] == 235
    assert s["cached_ratio"] == pytest.approx(235 / 360)
    assert s["prefill_tokens"] == 125
    assert s["completion_tokens"] == 24
    assert s["wall_s"] == pytest.approx(4.0)
    assert s["output_throughput_tok_s"] == pytest.approx(6.0)
    assert s["ttft_p50_s"] == pytest.approx(0.3)
    assert s["ttft_cont_p50_s"] == pytest.approx(0.2)
    assert s["exact_hits"] == 1 and s["later_turns"] == 2
    # time per output token after the first: (latency - ttft) / (completion - 1)
    assert records[0].tpot_s == pytest.approx((1.0 - 0.4) / 7)
    assert s["tpot_p50_s"] == pytest.approx((1.0 - 0.1) / 7)  # the turn-2 request
    assert _rec(completion=1).tpot_s is None and _rec(ttft=None).tpot_s is None

    floor = mt.summarize_floor(records)
    assert floor["requests"] == 1 and floor["cached_as_primed"] == 1
    assert floor["ttft_p50_s"] == 9.0 and floor["mean_computed_tokens"] == 17
    assert mt.summarize_floor([_rec()]) is None


def test_compare_targets():
    stock = {"prefill_tokens": 1000, "prefill_cont_tokens": 800, "output_throughput_tok_s": 100.0,
             "ttft_cont_p50_s": 0.5}  # fmt: skip
    plugin = {"prefill_tokens": 250, "prefill_cont_tokens": 100, "output_throughput_tok_s": 99.0,
              "ttft_cont_p50_s": 0.105}  # fmt: skip
    out = mt.compare({"aligned": stock, "request_boundaries": plugin}, {"ttft_p50_s": 0.1})
    assert out["info"]["prefill_cont_vs_stock"] == pytest.approx(0.125)
    assert out["ratios"]["prefill_vs_stock"] == pytest.approx(0.25)
    assert out["ratios"]["throughput_vs_stock"] == pytest.approx(0.99)
    assert out["ratios"]["continuation_ttft_vs_floor"] == pytest.approx(1.05)
    assert out["passed"] == {"continuation_ttft_vs_floor": True, "prefill_vs_stock": True,
                             "throughput_vs_stock": True}  # fmt: skip
    worse = dict(plugin, prefill_tokens=400, output_throughput_tok_s=90.0, ttft_cont_p50_s=0.2)
    out = mt.compare({"aligned": stock, "request_boundaries": worse}, {"ttft_p50_s": 0.1})
    assert not any(out["passed"].values())
    out = mt.compare({"request_boundaries": plugin}, None)
    assert out["ratios"] == dict.fromkeys(out["ratios"]) and out["passed"] == dict.fromkeys(out["passed"])


# ------------------------------------------------------------------------------------------------
# prompt construction


def test_plans_are_seeded_share_the_system_prompt_and_stay_in_range():
    w = _workload()
    plans = mt.make_plans(w)
    assert plans == mt.make_plans(w)
    assert len(plans) == 3
    assert all(p.system_ids == plans[0].system_ids for p in plans)
    assert len(plans[0].system_ids) == 50
    assert all(len(p.user_turns) == 4 and all(len(u) == 10 for u in p.user_turns) for p in plans)
    ids = [t for p in plans for u in p.user_turns for t in u] + list(plans[0].system_ids)
    assert min(ids) >= mt.FIRST_RANDOM_ID and max(ids) < 1024
    assert plans[0].user_turns != plans[1].user_turns
    # more conversations never change the earlier ones; another seed changes everything
    assert mt.make_plans(_workload(conversations=5))[:3] == plans
    other = mt.make_plans(_workload(seed=8))
    assert other[0].system_ids != plans[0].system_ids and other[0].user_turns != plans[0].user_turns
    assert mt.make_plans(_workload(system_tokens=0))[0].system_ids == ()
    with pytest.raises(ValueError):
        mt.draw_ids(random.Random(0), 3, 4)


def test_prompts_across_turns_extend_the_previous_prompt_and_answer():
    w = _workload(conversations=1)
    plan = mt.make_plans(w)[0]
    prompt = mt.first_prompt(plan)
    assert prompt == list(plan.system_ids) + list(plan.user_turns[0])
    answers = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]]
    for k in range(1, w.turns):
        previous = prompt
        prompt = mt.next_prompt(previous, answers[k - 1], plan.user_turns[k])
        assert prompt[: len(previous)] == previous
        assert prompt[len(previous): len(previous) + 6] == answers[k - 1]
        assert prompt[-10:] == list(plan.user_turns[k])
        boundary = mt.exact_boundary(len(previous), len(answers[k - 1]))
        assert boundary == len(previous) + 6 - 1
        # an exact boundary hit computes the last answer token and the new user tokens
        assert len(prompt) - boundary == w.user_tokens + 1
    assert len(prompt) == w.max_prompt_tokens()
    assert w.max_sequence_tokens() == w.max_prompt_tokens() + w.answer_tokens
    assert mt.exact_boundary(80, 0) == 80


def test_floor_prompts_on_the_block_grid():
    rng = random.Random(1)
    prompt = [rng.randrange(4, 1024) for _ in range(468)]  # 400 prompt + 8 answer + 60 user
    boundary, new = 407, 61
    fp = mt.floor_prompts(prompt, boundary, new, 256)
    assert fp.prefix_len == 256
    assert fp.prime == prompt[:256] + [prompt[407]]
    assert fp.timed == prompt[:256] + prompt[407:468]
    assert len(fp.prime) == 257 and len(fp.timed) == 256 + new
    assert fp.timed[: len(fp.prime)] == fp.prime  # the timed request shares the primed prefix

    on_grid = mt.floor_prompts(prompt, 256, 61, 128)
    assert on_grid.prefix_len == 256 and on_grid.timed == prompt[:256] + prompt[256:317]

    # a boundary shorter than one block: L0 = one block, padded with filler ids
    short = mt.floor_prompts(prompt[:104], 87, 17, 256, filler=lambda k: [5] * k)
    assert short.prefix_len == 256
    assert short.prime == prompt[:87] + [5] * 169 + [prompt[87]]
    assert short.timed == prompt[:87] + [5] * 169 + prompt[87:104]
    with pytest.raises(ValueError):
        mt.floor_prompts(prompt[:104], 87, 17, 256)  # needs a filler
    with pytest.raises(ValueError):
        mt.floor_prompts(prompt, 460, 61, 256)  # tail overruns the prompt
    assert [mt.floor_prefix_len(b, 544) for b in (0, 543, 544, 2263)] == [544, 544, 544, 2176]


# ------------------------------------------------------------------------------------------------
# log parsing

STATS_LINE = (
    "(EngineCore pid=12559) INFO 11-29 17:08:0{i} [scheduler.py:382] boundary_checkpoints: hits={i}, "
    "misses=1, tokens_restored=407, published=2, duplicates=0, evictions=0, captures_dropped=0, "
    "checkpoints_retained=2, blocks_retained=9, bytes_retained={b}, captures_pending=1"
)
BLOCK_LINE = (
    "(VllmWorker-0 pid=12627) INFO 11-29 17:07:53 [interface.py:1096] Setting attention block size to "
    "{n} tokens to ensure that attention page size is >= mamba page size."
)


def test_parse_bytes_retained_takes_the_last_stats_line():
    log = "\n".join([
        "(EngineCore pid=1) INFO [scheduler.py:157] boundary_checkpoints: request_boundaries active: 4 KV groups",
        STATS_LINE.format(i=1, b=0),
        "some other line bytes_retained=77",
        STATS_LINE.format(i=2, b=1179648),
        "(APIServer pid=2) INFO: 127.0.0.1 - POST /v1/completions 200 OK",
    ])  # fmt: skip
    assert mt.parse_bytes_retained(log) == 1179648
    stats = mt.parse_boundary_stats(log)
    assert stats["hits"] == 2 and stats["tokens_restored"] == 407 and stats["captures_pending"] == 1
    assert mt.parse_bytes_retained("no stats here\nbytes_retained=5\n") is None
    assert mt.parse_boundary_stats("") is None
    # a line whose counters are followed by other text still yields bytes_retained
    assert mt.parse_bytes_retained("boundary_checkpoints: bytes_retained=42 (3 checkpoints)") == 42


def test_parse_block_size_and_its_precedence():
    log = "\n".join(["noise", BLOCK_LINE.format(n=544), "kv lcm block sizes 544"])
    assert mt.parse_block_size(log) == 544
    assert mt.parse_block_size(BLOCK_LINE.format(n=256) + "\n" + BLOCK_LINE.format(n=512)) == 512
    assert mt.parse_block_size("kv cache group sizes (256,)") is None
    assert mt.resolve_block_size(1088, log, []) == (1088, "--block-size")
    assert mt.resolve_block_size(None, log, ["--block-size", "64"])[0] == 544
    assert mt.resolve_block_size(None, "", ["--block-size", "64"]) == (64, "--server-arg --block-size")
    assert mt.resolve_block_size(None, "", ["--block-size=128"])[0] == 128
    assert mt.resolve_block_size(None, "", []) == (None, "unknown")


def test_server_arg_value_last_one_wins():
    argv = ["--max-model-len", "4096", "--enforce-eager", "--max-model-len", "40000"]
    assert mt.server_arg_value(argv, "--max-model-len") == "40000"
    assert mt.server_arg_value(argv + ["--max-model-len=8192"], "--max-model-len") == "8192"
    assert mt.server_arg_value(argv, "--block-size") is None
    assert mt._split_server_args(["--load-format dummy", "--max-model-len=40000"]) == [
        "--load-format", "dummy", "--max-model-len=40000"]  # fmt: skip


def test_plugin_logging_config_routes_plugin_lines_to_stdout(tmp_path):
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(mt.plugin_logging_config()))
    code = (
        "import json, logging, logging.config, sys;"
        f"logging.config.dictConfig(json.load(open({str(path)!r})));"
        "logging.getLogger('boundary_checkpoints.core.scheduler').info("
        "'boundary_checkpoints: hits=1, bytes_retained=4096');"
        "logging.getLogger('vllm.x').info('Setting attention block size to 256 tokens to ensure');"
        "logging.getLogger('other').info('dropped')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert mt.parse_bytes_retained(out) == 4096
    assert mt.parse_block_size(out) == 256
    assert "dropped" not in out


# ------------------------------------------------------------------------------------------------
# reports and CLI


def _fake_result(tmp_path):
    w = _workload(conversations=2, turns=2)
    runs = {}
    for policy, cached in (("aligned", 0), ("request_boundaries", 65)):
        run = mt.PolicyRun(mt.Target(policy, "http://x", "m"), w, [], "salt", block_size=256,
                           measure_floor=policy == "aligned")  # fmt: skip
        for conv in range(2):
            run.records.append(_rec(policy, conv=conv, turn=1, prompt=60, ttft=0.3, answer=[1, 2]))
            run.records.append(_rec(policy, conv=conv, turn=2, prompt=76, cached=cached, boundary=65,
                                    ttft=0.3 if cached == 0 else 0.1, start=1, end=2, answer=[3]))  # fmt: skip
            if policy == "aligned":
                run.records.append(_rec(policy, "floor", conv=conv, turn=2, prompt=267, cached=256,
                                        boundary=256, ttft=0.09))  # fmt: skip
        runs[policy] = run
    servers = {"aligned": {"bytes_retained": None}, "request_boundaries": {"bytes_retained": 2 << 20}}
    return mt.build_result(w, ["aligned", "request_boundaries"], runs, servers, 256, "test", "aligned",
                           {"argv": []})  # fmt: skip


def test_reports_from_a_result(tmp_path):
    result = _fake_result(tmp_path)
    json.dumps(result)  # everything is JSON-serialisable
    summ = result["summary"]
    assert summ["policies"]["request_boundaries"]["exact_hits"] == 2
    assert summ["same_answers"]["request_boundaries"] == "4/4"
    assert summ["floor"]["cached_as_primed"] == 2
    assert summ["targets"]["ratios"]["continuation_ttft_vs_floor"] == pytest.approx(0.1 / 0.09)
    table = mt.summary_table(result)
    assert "2.0 MiB" in table and "n/a" in table and "floor (aligned server" in table
    assert "| metric | aligned | request_boundaries |" in mt.summary_table(result, markdown=True)
    assert "FAIL" in mt.targets_text(result) or "PASS" in mt.targets_text(result)
    turns = mt.per_turn_table(result)
    assert "floor L0" in turns and turns.count("\n") == 3
    png = tmp_path / "plot.png"
    drawn = mt.plot_results(result, png)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert drawn is False and not png.exists()
    else:
        assert drawn is True and png.stat().st_size > 0


def test_cli_argument_checks(capsys):
    with pytest.raises(SystemExit):
        mt.parse_args([])
    with pytest.raises(SystemExit):
        mt.parse_args(["--url", "http://x"])  # --model missing
    with pytest.raises(SystemExit):
        mt.parse_args(["--url", "http://x", "--launch", "d", "--model", "m"])
    with pytest.raises(SystemExit):
        mt.parse_args(["--launch", "d", "--additional-config", "[1]"])
    args = mt.parse_args(["--launch", "d", "--server-arg=--load-format dummy", "--server-arg=--no-enforce-eager"])
    assert args.policies == ["aligned", "request_boundaries"] and args.floor is None
    assert mt._split_server_args(args.server_arg) == ["--load-format", "dummy", "--no-enforce-eager"]
    variant = 'fast={"policy": "request_boundaries", "prompt_checkpoints": false}'
    args = mt.parse_args(["--launch", "d", "--variant", variant])
    assert args.policies == ["aligned", "request_boundaries", "fast"]
    assert args.sections["fast"] == {"policy": "request_boundaries", "prompt_checkpoints": False}
    assert args.sections["aligned"] == {"policy": "aligned"}
    for bad in ("fast=[1]", "fast={", 'aligned={"policy": "auto"}', '={"policy": "auto"}'):
        with pytest.raises(SystemExit):
            mt.parse_args(["--launch", "d", "--variant", bad])
    assert mt.main(["--url", "http://127.0.0.1:9", "--model", "m"]) == 2  # no vocab size
    assert "--vocab-size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arch, architecture, vocab",
    [("qwen3_next_80b_12l", "Qwen3NextForCausalLM", 151936), ("qwen35_9b", "Qwen3_5ForCausalLM", 248320)],
)
def test_write_model_real_size_config_and_full_vocab_tokenizer(tmp_path, arch, architecture, vocab):
    from transformers import AutoConfig, AutoTokenizer

    out = mt.write_model(tmp_path / arch, arch)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [architecture]
    assert mt.model_vocab_size(out) == vocab
    config = AutoConfig.from_pretrained(str(out))
    assert config.vocab_size == vocab
    if arch == "qwen3_next_80b_12l":
        assert (config.hidden_size, config.num_hidden_layers) == (2048, 12)
        assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + [
            "linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]  # fmt: skip
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 2, 256)
        assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 32)
        dims = (config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim)
        assert dims == (128, 128, 4)
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (512, 10, 512)
        assert config.shared_expert_intermediate_size == 512
    else:
        assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (4096, 32, 12288)
        assert config.layer_types.count("full_attention") == 8
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == vocab
    ids = [4, 5, vocab - 1, 1000, vocab // 2]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids


def test_write_model_tiny_reuses_the_fixture(tmp_path):
    out = mt.write_model(tmp_path / "tiny", "tiny")
    assert (out / "model.safetensors").is_file() and mt.model_vocab_size(out) == 1024


# ------------------------------------------------------------------------------------------------
# end to end: two real CPU servers of the tiny model


@pytest.mark.slow
def test_end_to_end_both_policies_on_cpu_servers(tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "multi_turn.json"
    argv = [
        "--launch", str(tiny_model_dir), "--policies", "aligned,request_boundaries",
        "-N", "2", "-T", "3", "-S", "64", "-U", "16", "-A", "8", "-C", "2",
        "--log-dir", str(tmp_path / "logs"), "--out-json", str(out_json),
        "--startup-timeout", "300", "--warmup", "0",
    ]  # fmt: skip
    assert mt.main(argv) == 0
    printed = capsys.readouterr().out
    assert "cached-token ratio" in printed and "targets:" in printed
    result = json.loads(out_json.read_text())
    assert result["block_size"] == 256 and result["block_size_source"].startswith("server log")
    records = result["records"]

    def conv(policy):
        return sorted((r for r in records if r["policy"] == policy and r["phase"] == "conversation"),
                      key=lambda r: (r["conversation"], r["turn"]))  # fmt: skip

    for policy in ("aligned", "request_boundaries"):
        rows = conv(policy)
        assert len(rows) == 6 and all(r["error"] is None for r in rows)
        assert all(r["cached_tokens"] is not None and r["ttft_s"] > 0 for r in rows)
        assert all(r["completion_tokens"] == 8 and len(r["answer_ids"]) == 8 for r in rows)
        by_conv = {}
        for r in rows:  # turn k prompt = turn k-1 prompt + 8 answer ids + 16 user ids
            assert r["prompt_tokens"] == 64 + 16 + (r["turn"] - 1) * 24
            if r["turn"] > 1:
                prev = by_conv[r["conversation"]]
                assert r["boundary"] == prev["prompt_tokens"] + 8 - 1
            by_conv[r["conversation"]] = r
    # stock hits only on the 256-token block grid: every prompt here is shorter than one block
    assert all(r["cached_tokens"] % 256 == 0 for r in conv("aligned"))
    # the plugin resumes exactly at the previous turn's committed length
    later = [r for r in conv("request_boundaries") if r["turn"] >= 2]
    assert [r["cached_tokens"] for r in later] == [r["boundary"] for r in later]
    # floor: primed prefix L0 = one block is cached exactly, U + 1 tokens computed
    floor = [r for r in records if r["phase"] == "floor"]
    assert len(floor) == 4 and all(r["policy"] == "aligned" for r in floor)
    assert all(r["boundary"] == 256 and r["cached_tokens"] == 256 and r["prompt_tokens"] == 273 for r in floor)
    servers = result["servers"]
    assert servers["aligned"]["bytes_retained"] is None
    assert isinstance(servers["request_boundaries"]["bytes_retained"], int)
    assert servers["request_boundaries"]["bytes_retained"] > 0
    assert all(s["exit_code"] is not None for s in servers.values())
    summ = result["summary"]
    assert summ["policies"]["request_boundaries"]["cached_ratio"] > summ["policies"]["aligned"]["cached_ratio"]
    assert summ["floor"]["ttft_p50_s"] > 0
