"""Three servers up at once (stock default, stock --prefix-match-unit 16, plugin), then bc-bench --url on all three."""
import sys
from pathlib import Path
from bc_tools.bench.server import start_server, wait_until_healthy, stop_server, policy_config
from bc_tools.bench.cli import main

model = Path.home() / ".cache/boundary_checkpoints/tiny_qwen3_next"
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
specs = [("aligned", policy_config("aligned"), []),
         ("aligned_unit16", policy_config("aligned"), ["--prefix-match-unit", "16"]),
         ("request_boundaries", {"boundary_checkpoints": {"policy": "request_boundaries", "stats_log_interval_s": 1}}, [])]
servers = [(label, start_server(model, out / f"{label}.log", additional_config=cfg, extra_args=extra, served_model_name="tiny"), out / f"{label}.log") for label, cfg, extra in specs]
try:
    for _, s, _ in servers:
        wait_until_healthy(s, timeout=400)
    args = []
    for label, s, log in servers:
        args += ["--url", s.base_url, "--label", label, "--server-log", str(log)]
    args += ["--model", "tiny"] + sys.argv[2:]
    rc = main(args)
finally:
    for _, s, _ in servers:
        stop_server(s)
sys.exit(rc)
