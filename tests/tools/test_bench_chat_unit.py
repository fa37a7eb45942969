"""Fast tests of ``bc-bench``'s chat mode (``--mode chat``) and its lost-hits row: the shared word
helpers, the message construction (pure functions), the lost-hits count on synthetic records, and
whole runs against stand-in chat servers (no vLLM engine). The real-server run is in
``test_multi_turn_bench_models.py``."""

from __future__ import annotations

import json
import random

import pytest
from http_stub import QuietHandler, cached_prefix, send_completion, send_event_stream, serve

from bc_tools.bench import chat_words, cli, cli_args, demo_conversation, report, stats
from bc_tools.bench import workload as wl
from bc_tools.bench.stats import RequestRecord


def _workload(**kw):
    base = dict(conversations=3, turns=3, system_tokens=12, user_tokens=5, answer_tokens=4,
                concurrency=1, vocab_size=1024, seed=3, mode="chat")  # fmt: skip
    base.update(kw)
    return wl.Workload(**base)


# ------------------------------------------------------------------------------------------------
# words


def test_draw_words_is_what_bc_demo_always_drew():
    a, b = random.Random(5), random.Random(5)
    expected = " ".join(f"w{b.randrange(chat_words.FIRST_PLAIN_WORD_ID, chat_words.TINY_VOCAB_SIZE)}" for _ in range(9))
    assert chat_words.draw_words(a, 9) == expected
    assert chat_words.draw_words(random.Random(0), 0) == ""
    assert chat_words.draw_words(random.Random(0), 3, ["x"]) == "x x x"
    # bc-demo's chat plan draws through the shared helper
    plan = demo_conversation.make_chat_plan(turns=2, system_tokens=4, user_tokens=3, followup_tokens=2, seed=1)
    rng = random.Random(1)
    assert plan.turn_messages[0][1]["content"] == chat_words.draw_words(rng, 3)  # the user message is drawn first
    assert plan.turn_messages[0][0]["content"] == chat_words.draw_words(rng, 4)


def test_tokenizer_words(tmp_path):
    assert chat_words.tokenizer_words(None) is None
    assert chat_words.tokenizer_words(tmp_path) is None  # no tokenizer.json
    vocab = {"<unk>": 0, "<s>": 1, "system": 2, "user": 3, **{f"w{i}": i for i in range(4, 204)}}
    spec = {"model": {"type": "WordLevel", "vocab": vocab}, "added_tokens": [{"content": "<unk>"}, {"content": "<s>"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert chat_words.tokenizer_words(tmp_path) == tuple(f"w{i}" for i in range(4, 204))
    bpe = {f"\u0120{w}": i for i, w in enumerate(f"word{chr(97 + i % 26)}{chr(97 + i // 26)}" for i in range(150))}
    bpe.update({"\u0120Caps": 900, "\u0120x1": 901, "plain": 902, "\u0120ab": 903})
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": bpe}}))
    words = chat_words.tokenizer_words(tmp_path)
    assert len(words) == 150 and words[0] == "wordaa" and not {"Caps", "x1", "plain", "ab"} & set(words)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"\u0120abc": 0}}}))
    assert chat_words.tokenizer_words(tmp_path) is None  # too few words


def test_tiny_model_tokenizer_words_are_its_plain_words(tiny_model_dir):
    assert chat_words.tokenizer_words(tiny_model_dir) == chat_words.TINY_WORDS


# ------------------------------------------------------------------------------------------------
# message construction


def test_chat_plans_share_the_system_text_and_are_seeded():
    w = _workload()
    plans = wl.make_chat_plans(w)
    assert plans == wl.make_chat_plans(w) and len(plans) == 3
    assert len({p.system_text for p in plans}) == 1 and len(plans[0].system_text.split()) == 12
    assert all(len(p.user_texts) == 3 and all(len(u.split()) == 5 for u in p.user_texts) for p in plans)
    assert plans[0].user_texts != plans[1].user_texts
    assert set(plans[0].system_text.split()) <= set(chat_words.TINY_WORDS)
    assert wl.make_chat_plans(_workload(conversations=5))[:3] == plans  # more never changes the earlier
    assert wl.make_chat_plans(_workload(seed=4))[0].system_text != plans[0].system_text
    # one-turn conversations (--turn1-only) still share the system text, whatever shared_system says
    one = wl.make_chat_plans(_workload(turns=1, shared_system=False))
    assert len({p.system_text for p in one}) == 1 and one[0].system_text == plans[0].system_text
    assert set(wl.make_chat_plans(_workload(), words=["a", "b"])[0].system_text.split()) == {"a", "b"}


def test_chat_messages_per_turn():
    plan = wl.ChatConversationPlan(index=0, system_text="s1 s2", user_texts=("u1", "u2", "u3"))
    assert wl.chat_messages(plan, []) == [{"role": "system", "content": "s1 s2"}, {"role": "user", "content": "u1"}]
    assert wl.chat_messages(plan, ["a1", "a2"]) == [
        {"role": "system", "content": "s1 s2"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]
    with pytest.raises(ValueError):
        wl.chat_messages(plan, ["a1", "a2", "a3"])
    no_system = wl.ChatConversationPlan(index=1, system_text="", user_texts=("u1",))
    assert wl.chat_messages(no_system, []) == [{"role": "user", "content": "u1"}]


def test_chat_workload_leaves_room_for_the_template():
    tokens = _workload(mode="tokens")
    assert tokens.max_prompt_tokens() == 12 + 3 * 5 + 2 * 4
    assert _workload().max_prompt_tokens() == tokens.max_prompt_tokens() + wl.CHAT_TOKENS_PER_MESSAGE * 7


def test_cli_mode_and_tokenizer_options():
    args = cli_args.parse_args(["--launch", "d", "--mode", "chat", "--turn1-only"])
    assert args.mode == "chat" and args.turns == 1
    assert cli_args.parse_args(["--launch", "d"]).mode == "tokens"
    for bad in (["--mode", "text"], ["--tokenizer", "x"]):  # unknown mode; --tokenizer without chat
        with pytest.raises(SystemExit):
            cli_args.parse_args(["--launch", "d", *bad])


# ------------------------------------------------------------------------------------------------
# lost hits


def _rec(policy, cached, conv=0, turn=2, round_index=0, phase="conversation", error=None, in_flight=1):
    return RequestRecord(policy=policy, phase=phase, conversation=conv, turn=turn, prompt_tokens=600,
                         cached_tokens=cached, completion_tokens=4, boundary=0, ttft_s=0.1, latency_s=0.2,
                         start_s=0.0, end_s=0.2, error=error, in_flight=in_flight, round=round_index)  # fmt: skip


LABELS = ["aligned", "request_boundaries"]


def test_lost_hits_counts_requests_cached_below_stock():
    records = [
        _rec("aligned", 512, conv=0), _rec("request_boundaries", 300, conv=0),  # lost 212
        _rec("aligned", 256, conv=1), _rec("request_boundaries", 0, conv=1),  # lost 256
        _rec("aligned", 256, conv=2), _rec("request_boundaries", 520, conv=2),  # a gain, not a loss
        _rec("aligned", 256, conv=0, round_index=1), _rec("request_boundaries", 256, conv=0, round_index=1),
        # pairs only on the same round, conversation and turn
        _rec("aligned", 512, conv=3, turn=1), _rec("request_boundaries", 0, conv=3, turn=2),
        # not conversation requests, failed ones, or unknown cached_tokens: not compared
        _rec("aligned", 512, conv=4, phase="floor"), _rec("request_boundaries", 0, conv=4, phase="floor"),
        _rec("aligned", 512, conv=5), _rec("request_boundaries", None, conv=5, error="HTTP 500"),
        _rec("aligned", 512, conv=6, in_flight=2), _rec("request_boundaries", 0, conv=6, in_flight=1),
    ]  # fmt: skip
    out = stats.lost_hits(records, LABELS)
    assert out == {"request_boundaries": {"requests": 2, "tokens_lost": 468, "compared": 4}}
    # a third label is judged on its own
    out = stats.lost_hits(records + [_rec("other", 100, conv=0)], [*LABELS, "other"])
    assert out["other"] == {"requests": 1, "tokens_lost": 412, "compared": 1}


def test_first_turns_are_paired_by_rank_of_their_hits():
    # A shared prefix's one cold start fell on another conversation: no hit is lost.
    stock = [_rec("aligned", cached, conv=c, turn=1) for c, cached in enumerate((0, 7392, 7392))]
    mine = [_rec("request_boundaries", cached, conv=c, turn=1) for c, cached in enumerate((7392, 0, 7392))]
    assert stats.lost_hits(stock + mine, LABELS) == {
        "request_boundaries": {"requests": 0, "tokens_lost": 0, "compared": 3}
    }
    # Two cold starts where stock had one: one request lost its hit.
    mine[2] = _rec("request_boundaries", 0, conv=2, turn=1)
    assert stats.lost_hits(stock + mine, LABELS)["request_boundaries"]["tokens_lost"] == 7392


def test_no_lost_hits_and_no_stock_label():
    records = [_rec("aligned", 256, conv=c) for c in range(3)] + [
        _rec("request_boundaries", cached, conv=c) for c, cached in enumerate((256, 300, 511))
    ]
    assert stats.lost_hits(records, LABELS) == {"request_boundaries": {"requests": 0, "tokens_lost": 0, "compared": 3}}
    assert stats.lost_hits(records, ["request_boundaries", "x"]) is None


def _level(lost, labels=LABELS):
    spread = {"median": 1.0, "p25": 1.0, "p75": 1.0, "n": 1}
    return {
        "in_flight": 1,
        "conversations": 2,
        "rounds": [{"policies": {p: {"errors": 0} for p in labels}}],
        "summary": {
            "policies": {p: {"requests": spread} for p in labels},
            "floor": None,
            "ratios": {},
            "per_turn": {
                p: {"1": {"requests": 2, "prompt_tokens": 200, "boundary": 0, "cached_tokens": 76.5, "ttft_p50_s": 0.1}}
                for p in labels
            },
            "lost_hits": lost,
            "turn1_cached_median": {"aligned": 0.0, "request_boundaries": 153.0},
        },
    }


def _result(labels=LABELS, mode="chat"):
    return {"policies": labels, "workload": {"turns": 1, "mode": mode}, "floor_policy": None, "block_size": 256}


def _row(table: str, name: str) -> list[str]:
    (line,) = [x for x in table.splitlines() if x.startswith(f"| {name} |")]
    return [c.strip() for c in line.strip("|").split("|")][1:]


def test_report_lost_hits_row_and_turn1_cached_line():
    lost = stats.lost_hits([_rec("aligned", 512), _rec("request_boundaries", 300)], LABELS)
    table = report.summary_table(_result(), _level(lost), markdown=True)
    assert _row(table, report.LOST_HITS_ROW) == ["", "1 (212)"]
    none_lost = stats.lost_hits([_rec("aligned", 512), _rec("request_boundaries", 512)], LABELS)
    table = report.summary_table(_result(), _level(none_lost), markdown=True)
    assert _row(table, report.LOST_HITS_ROW) == ["", "0 (0)"]
    no_stock = ["request_boundaries", "other"]
    table = report.summary_table(_result(no_stock), _level(None, no_stock), markdown=True)
    assert _row(table, report.LOST_HITS_ROW) == ["", ""]
    text = report.level_text(_result(), _level(lost), markdown=True)
    assert "turn-1 cached tokens: median per policy" in text and "aligned 0, request_boundaries 153" in text
    assert _row(text, "1")[2:4] == ["76", "76"]  # turn 1's row of the per-turn table (mean cached)
    assert "turn-1 cached tokens" not in report.level_text(_result(mode="tokens"), _level(lost))


def test_turn1_cached_median():
    records = [_rec("p", c, conv=i, turn=1) for i, c in enumerate((0, 153, 153, 153))] + [_rec("p", 999, turn=2)]
    assert stats.turn1_cached_median(records, "p") == 153
    assert stats.turn1_cached_median(records, "q") is None


# ------------------------------------------------------------------------------------------------
# whole runs against stand-in chat servers

ROLES = {"system": 4, "user": 5, "assistant": 6, "tool": 7}


def _word_ids(text: str) -> list[int]:
    return [1 if w == "<s>" else 2 if w == "</s>" else int(w[1:]) for w in text.split()]


def _render(messages: list[dict]) -> list[int]:
    """The tiny model's chat template, as ids (one per word)."""
    ids = []
    for m in messages:
        ids += [1, ROLES[m["role"]], *_word_ids(m["content"]), 2]
    return ids + [1, ROLES["assistant"]]


def _answer(prompt: list[int], max_tokens: int) -> list[int]:
    return [(sum(prompt) + i) % 1000 + 8 for i in range(max_tokens)]


def _chat_stub(cache: bool):
    """A stand-in server of both endpoints: renders chat messages like the tiny template, answers
    ``max_tokens`` words derived from the prompt, and reports as cached the longest prefix shared
    with an earlier prompt under the same salt (``cache=False``: always 0)."""

    class Stub(QuietHandler):
        seen: dict[str, list[list[int]]] = {}
        requests: list[tuple[str, dict]] = []

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            type(self).requests.append((self.path, body))
            chat = self.path == "/v1/chat/completions"
            prompt = _render(body["messages"]) if chat else body["prompt"]
            history = type(self).seen.setdefault(body.get("cache_salt"), [])
            cached = cached_prefix(history, prompt) if cache else 0
            answer = _answer(prompt, body["max_tokens"])
            history.append(prompt + answer)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(answer),
                     "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
            if not body.get("stream"):
                send_completion(self, answer, usage)
                return
            chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": prompt}]
            for i, tok in enumerate(answer):
                text = f"{' ' if i else ''}w{tok}"
                choice = {"delta": {"content": text}} if chat else {"text": text}
                chunks.append(
                    {
                        "choices": [
                            {**choice, "token_ids": [tok], "finish_reason": "length" if i == len(answer) - 1 else None}
                        ]
                    }
                )
            chunks.append({"choices": [], "usage": usage})
            send_event_stream(self, chunks if chat else chunks[1:])

    return Stub


def _chat_bodies(stub) -> list[dict]:
    return [b for path, b in stub.requests if path == "/v1/chat/completions" and "warmup" not in b["cache_salt"]]


def test_chat_run_sends_messages_and_reports(tmp_path, capsys):
    stock, plugin = _chat_stub(cache=True), _chat_stub(cache=False)
    out_json = tmp_path / "chat.json"
    with serve(stock) as a, serve(plugin) as b:
        argv = ["--url", a, "--url", b, "--label", "aligned", "--label", "request_boundaries", "--model", "m",
                "--vocab-size", "1024", "--mode", "chat", "-N", "2", "-T", "3", "-S", "20", "-U", "6", "-A", "4",
                "-C", "1", "--repeat", "2", "--floor", "--block-size", "16", "--markdown",
                "--out-json", str(out_json)]  # fmt: skip
        assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    bodies = _chat_bodies(stock)
    assert len(bodies) == 2 * 2 * 3  # rounds x conversations x turns
    for body in bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0.0 and body["max_tokens"] == 4 and body["ignore_eos"] is True
        assert body["messages"][0]["role"] == "system" and len(body["messages"][0]["content"].split()) == 20
        pairs = (len(body["messages"]) - 2) // 2
        assert [m["role"] for m in body["messages"][1:]] == ["user", "assistant"] * pairs + ["user"]
    assert len({b["messages"][0]["content"] for b in bodies}) == 1  # one system message for all
    assert len({b["cache_salt"] for b in bodies}) == 2  # one salt per slot (round)
    assert len({b["cache_salt"] for b in _chat_bodies(plugin)} & {b["cache_salt"] for b in bodies}) == 0
    # each answer's text comes back as the next turn's assistant message
    for body in bodies:
        for k in range(2, len(body["messages"]), 2):
            answered = _answer(_render(body["messages"][:k]), 4)
            assert body["messages"][k] == {"role": "assistant", "content": " ".join(f"w{t}" for t in answered)}
    second = [json.dumps(b["messages"]) for b in bodies if len(b["messages"]) == 4]
    assert sorted(json.dumps(b["messages"][:4]) for b in bodies if len(b["messages"]) == 6) == sorted(second)
    result = json.loads(out_json.read_text())
    assert result["workload"]["mode"] == "chat" and result["workload"]["shared_system"] is True
    records = [r for r in result["records"] if r["phase"] == "conversation"]
    for r in records:  # the server's counts: 3 template words around each message, 2 for the generation prompt
        assert r["prompt_tokens"] == 23 + 9 + 2 + (r["turn"] - 1) * (7 + 9)
        assert r["completion_tokens"] == 4 and len(r["answer_ids"]) == 4 and r["ttft_s"] is not None
    aligned = {(r["round"], r["conversation"], r["turn"]): r for r in records if r["policy"] == "aligned"}
    for key, r in aligned.items():
        if key[2] >= 2:  # the exact prefix of the previous prompt + answer (the stub's last answer token too)
            assert r["cached_tokens"] >= r["boundary"] == 34 + (key[2] - 2) * 16 + 4 - 1
    assert all(aligned[(rd, 1, 1)]["cached_tokens"] == 23 + 2 for rd in (0, 1))  # system block + "<s> user"
    # the plugin stand-in caches nothing: every request stock cached something on is a lost hit
    summary = result["levels"][0]["summary"]
    lost = sum(1 for r in aligned.values() if r["cached_tokens"])
    tokens_lost = sum(r["cached_tokens"] for r in aligned.values())
    assert lost == 10 and summary["lost_hits"]["request_boundaries"] == {
        "requests": lost, "tokens_lost": tokens_lost, "compared": 12}  # fmt: skip
    assert _row(printed, report.LOST_HITS_ROW)[:2] == ["", f"{lost} ({tokens_lost})"]
    assert "turn-1 cached tokens: median per policy" in printed and "(chat mode)" in printed
    assert _row(printed, "1")[0] == "34"  # the per-turn table has turn 1 (prompt 34)
    # the floor runs on the ids the server rendered, through /v1/completions: L0 on the 16 grid, then
    # what an exact hit computes (the last answer token, "</s>", the user message, the generation prompt)
    floor = [r for r in result["records"] if r["phase"] == "floor"]
    assert len(floor) == 2 * 2 * 2 and all(r["boundary"] % 16 == 0 and r["cached_tokens"] >= r["boundary"]
                                           and r["prompt_tokens"] - r["boundary"] == 13 for r in floor)  # fmt: skip


def test_chat_turn1_only_shares_the_system_message(tmp_path, capsys):
    stock = _chat_stub(cache=True)
    out_json = tmp_path / "t1.json"
    with serve(stock) as a:
        argv = ["--url", a, "--label", "aligned", "--model", "m", "--vocab-size", "1024", "--mode", "chat",
                "--turn1-only", "-N", "3", "-S", "15", "-U", "5", "-A", "2", "-C", "1", "--repeat", "1",
                "--out-json", str(out_json)]  # fmt: skip
        assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    records = sorted((r for r in result["records"] if r["phase"] == "conversation"), key=lambda r: r["conversation"])
    assert [r["turn"] for r in records] == [1, 1, 1]
    assert [r["cached_tokens"] for r in records] == [0, 18 + 2, 18 + 2]  # the shared system block + "<s> user"
    assert result["levels"][0]["summary"]["turn1_cached_median"] == {"aligned": 20.0}
    assert "turn-1 cached tokens: median per policy (all rounds; the system message's reuse): aligned 20" in printed
    assert result["levels"][0]["summary"]["lost_hits"] == {}  # stock alone: no label to compare


@pytest.mark.parametrize(
    "rows",
    [
        # the plugin's capture-copy launches and their time per round
        {"capture-copy launches": ("capture_copies", 20, "20"),
         "capture-copy time ms": ("capture_copy_us", 5635, "5.63")},
        # the plugin's own estimate against stock, beside the measured lost hits
        {"plugin's estimate: tokens beyond stock": ("tokens_beyond_stock", 640, "640"),
         "plugin's estimate: stock tokens lost": ("stock_tokens_lost", 0, "0")},
    ],
)  # fmt: skip
def test_plugin_metric_rows_appear_where_metrics_carry_them(rows):
    """Rows read from ``/metrics`` show per round where the servers report them; a run whose
    servers report none (a multiprocess executor, stock) has no such rows."""
    level = _level(None)
    table = report.summary_table(_result(), level, markdown=True)
    assert not any(name in table for name in rows)
    for key, median, _ in rows.values():
        level["summary"]["policies"]["request_boundaries"][key] = {"median": median, "p25": 0, "p75": median, "n": 3}
    table = report.summary_table(_result(), level, markdown=True)
    for name, (_, _, shown) in rows.items():
        assert _row(table, name)[1].startswith(shown)


def test_rounds_below_stock_compares_each_round_s_totals():
    def rounds(*pairs):
        return [{"policies": {"aligned": {"cached_tokens": a}, "request_boundaries": {"cached_tokens": b}}}
                for a, b in pairs]  # fmt: skip

    level = rounds((104544, 103816), (104544, 106704), (104544, 104544))
    assert stats.rounds_below_stock(level, "request_boundaries") == {"below": 1, "rounds": 3, "worst": 103816 / 104544}
    assert stats.rounds_below_stock(rounds((0, 0)), "request_boundaries") == {"below": 0, "rounds": 1, "worst": None}
    assert stats.rounds_below_stock(level, "hold") is None
    table = report.summary_table(_result(), {**_level(None), "rounds": [
        {**rd, "policies": {p: {**v, "errors": 0} for p, v in rd["policies"].items()}} for rd in level
    ]}, markdown=True)  # fmt: skip
    assert _row(table, report.ROUNDS_BELOW_ROW) == ["", "1 of 3 (worst 0.993)"]
