# from the repository root: per-round ratios not printed by bc-bench, from the raw records of both runs
# (in_step / stop per round; at 8 in flight each slot's 16 requests are two waves of 8, split by start time)
/work/main/.venv/bin/python - <<'PY'
import gzip, json
from collections import defaultdict
import numpy as np
def q(v): return "%.2f [%.2f..%.2f]" % (np.median(v), np.percentile(v, 25), np.percentile(v, 75))
for f in ("turn1-in-step", "turn1-in-step-run2"):
    d = json.load(gzip.open(f"docs/results/cpu-bench/{f}.json.gz"))
    print(f"== {f}")
    for lv in d["levels"]:
        P = [r["policies"] for r in lv["rounds"]]
        for k in ("ttft_turn1_p50_s", "ttft_turn1_p90_s"):
            x = [p["request_boundaries"][k] / p["stop"][k] for p in P]
            print(f"in flight {lv['in_flight']}: {k} in_step / stop per round {q(x)}  {[round(v, 2) for v in x]}")
        for k in ("ttft_turn1_p90_s",):
            for n in ("request_boundaries", "stop"):
                x = [p[n][k] / p["aligned"][k] for p in P]
                print(f"in flight {lv['in_flight']}: {k} {n} / stock per round {q(x)}")
    g = defaultdict(list)
    for r in d["records"]:
        if r["in_flight"] == 8:
            g[(r["round"], r["policy"])].append(r)
    w = {1: defaultdict(list), 2: defaultdict(list)}
    for (rd, p), rs in sorted(g.items()):
        rs = sorted(rs, key=lambda r: r["start_s"])
        assert len(rs) == 16
        w[1][p].append(1000 * np.median([r["ttft_s"] for r in rs[:8]]))
        w[2][p].append(1000 * np.median([r["ttft_s"] for r in rs[8:]]))
    for i in (1, 2):
        for p in ("aligned", "request_boundaries", "stop"):
            print(f"in flight 8, wave {i} (requests {8 * i - 7}-{8 * i}) TTFT median ms per round, {p}: {[int(v) for v in w[i][p]]}")
        for p in ("request_boundaries", "stop"):
            print(f"in flight 8, wave {i}: {p} / stock per round {q(np.array(w[i][p]) / np.array(w[i]['aligned']))}")
        print(f"in flight 8, wave {i}: in_step / stop per round {q(np.array(w[i]['request_boundaries']) / np.array(w[i]['stop']))}")
PY
