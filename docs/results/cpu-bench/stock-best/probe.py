"""Stock vLLM 0.32 knobs on the tiny model: cached tokens for an exact resend and a next turn."""
import json, random, sys, uuid
from pathlib import Path
from bc_tools.bench.server import RunningServer, policy_config
from bc_tools.bench.client import complete

model = Path.home() / ".cache/boundary_checkpoints/tiny_qwen3_next"
variants = {
    "stock default": (policy_config("aligned"), []),
    "stock unit16": (policy_config("aligned"), ["--prefix-match-unit", "16"]),
    "stock unit16+interval": (policy_config("aligned"), ["--prefix-match-unit", "16", "--prefix-cache-retention-interval", "256"]),
    "plugin": (policy_config("request_boundaries"), []),
}
only = sys.argv[1:] or list(variants)
rng = random.Random(7)
results = {}
for name in only:
    cfg, extra = variants[name]
    with RunningServer(model, Path(f"/tmp/stockbest/{name.replace(' ', '_')}.log"), additional_config=cfg, extra_args=extra, timeout=300) as srv:
        rows = []
        for P in (300, 407, 530):
            r = random.Random(P)
            salt = uuid.uuid4().hex
            prompt = [r.randrange(8, 1024) for _ in range(P)]
            a = complete(srv.base_url, prompt, cache_salt=salt, max_tokens=16, ignore_eos=True)
            resend = complete(srv.base_url, prompt, cache_salt=salt, max_tokens=1)
            turn2 = prompt + a.token_ids + [r.randrange(8, 1024) for _ in range(60)]
            t2 = complete(srv.base_url, turn2, cache_salt=salt, max_tokens=1)
            rows.append(dict(P=P, resend_cached=resend.cached_tokens, resend_exact=P - 1,
                             turn2_cached=t2.cached_tokens, turn2_exact=P + 16 - 1))
        results[name] = rows
        print(name, json.dumps(rows), flush=True)
Path("/tmp/stockbest/result.json").write_text(json.dumps(results, indent=1))
