"""The servers a benchmark run sends to: one per label, handed out slot by slot.

Contract: a :class:`ServerSet` hands out one :class:`Target` per label (``acquire`` ...
``release``), warmed up with ``settings.warmup`` throw-away conversations (``slot.warm_up``)
before its first slot after each start. :class:`UrlServers` wraps servers that already run.
:class:`LaunchedServers` starts vLLM servers with the plugin's policy in ``--additional-config``
(``POLICY_ENV`` unset, so it cannot override that): all at once (default), each once the previous
one is healthy (``one_by_one``), or one at a time around each slot (``relaunch``, for hosts where
two servers do not fit). Every server started is stopped by ``close``, which the run calls also on
errors and interrupts. A launched server waits for health at most until the run's time budget
ends; one still starting then raises ``BudgetEndedDuringStart``.

With ``settings.sleep_others`` (either kind of set; launched servers not in ``relaunch`` mode)
exactly one server is awake while a slot runs: ``acquire`` first puts every other server that is
not known to sleep to sleep (``sleep_mode.put_to_sleep``), then wakes the slot's server unless it
is known to be awake, and warms it up again after each wake (its KV cache was discarded). Launched servers get
``sleep_mode.SLEEP_FLAG`` and ``SLEEP_ENV`` and start one by one, each put to sleep once healthy
before the next starts (the last stays awake). ``info[label]["sleep_others"]`` holds one entry per
slot of that label: the seconds to wake it (None: it was awake), to put each other server to
sleep (with the GPU memory the sleep freed, from the server log when known) and to warm it up;
``info[label]["startup_sleep"]`` the sleep after its start; ``info[label]["graph_capture"]`` what
its CUDA graph capture took (``logs.graph_capture``). A server without the endpoints (404)
or one that does not switch raises ``sleep_mode.SleepModeError``. With ``spec.keep_file`` as well,
launched servers outlive the run (``kept_servers``' contract): the next run of the same launch
adopts the live ones (``info[label]["kept"]``) instead of starting them and puts each to sleep, so
that its first slot wakes it with an empty cache.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bc_tools.bench import kept_servers, logs, sleep_mode
from bc_tools.bench.run_settings import BudgetEndedDuringStart, RoundBudget, Settings
from bc_tools.bench.slot import warm_up
from bc_tools.bench.traffic import Progress, Target

POLICY_ENV = "VLLM_BOUNDARY_CHECKPOINTS_POLICY"  # the plugin lets it override --additional-config


class ServerSet:
    """Hands out the target of a label for one slot (``acquire`` ... ``release``)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.info: dict[str, dict[str, Any]] = {}
        self._warm: set[str] = set()
        self._warmups: dict[str, int] = {}  # label -> warm-ups run (each with its own salt)
        self._asleep: dict[str, bool] = {}  # label -> known state under sleep_others (absent: unknown)
        self._slots = 0  # slots handed out so far (the index in the sleep_others entries)

    def _ready(self, target: Target, progress: Progress) -> Target:
        """Warm ``target`` up the first time it is handed out (per server start, and per wake). Each
        warm-up has its own salt: a server must not see the previous warm-up's prompts sent again
        (prompt admission counts a prompt sent again as a use)."""
        s = self.settings
        if target.label not in self._warm and s.warmup > 0:
            progress.write(f"[{target.label}] warm-up ({s.warmup} conversation(s))")
            n = self._warmups[target.label] = self._warmups.get(target.label, -1) + 1
            warm_up(target, s.workload, f"{s.run_salt}-warmup-{target.label}-{n}", s.warmup, s.request_timeout,
                    s.chat_words)  # fmt: skip
        self._warm.add(target.label)
        return target

    def acquire(self, label: str, progress: Progress) -> Target:
        """The target of ``label`` for one slot: up, the only one awake under ``sleep_others``, warm."""
        target = self._target(label, progress)
        slot, self._slots = self._slots, self._slots + 1
        if not self.settings.sleep_others:
            return self._ready(target, progress)
        entry: dict[str, Any] = {"slot": slot, "wake_s": None, "sleep_s": {}, "warmup_s": None}
        for other, other_target in self._up().items():
            if other != label and not self._asleep.get(other, False):
                entry["sleep_s"][other] = self._sleep(other_target, progress)
        if self._asleep.get(label, True):
            entry["wake_s"] = self._wake(target, progress)
        warm = label in self._warm
        start = time.monotonic()
        self._ready(target, progress)
        entry["warmup_s"] = None if warm or not self.settings.warmup else round(time.monotonic() - start, 3)
        self.info[label].setdefault("sleep_others", []).append(entry)
        return target

    def _target(self, label: str, progress: Progress) -> Target:
        """The target of ``label``, its server started if it is not up."""
        raise NotImplementedError

    def _up(self) -> dict[str, Target]:
        """The targets of the servers that are up, by label."""
        raise NotImplementedError

    def _sleep(self, target: Target, progress: Progress) -> dict[str, Any]:
        """Put ``target``'s server to sleep: the seconds it took and the GPU memory it freed."""
        offset = logs.log_size(target.log_path)
        try:
            seconds = sleep_mode.put_to_sleep(target.base_url)
        except sleep_mode.SleepModeError as err:
            raise sleep_mode.SleepModeError(f"[{target.label}] {err}") from err
        self._asleep[target.label] = True
        memory = sleep_mode.sleep_memory(logs.read_text(target.log_path, offset)) or {}
        freed = f", freed {memory['freed_gib']:g} GiB" if memory else ""
        progress.write(f"[{target.label}] asleep in {seconds:.1f} s{freed}")
        return {"s": round(seconds, 3), **memory}

    def _wake(self, target: Target, progress: Progress) -> float:
        """Wake ``target``'s server (its next slot warms it up again); the seconds it took."""
        try:
            seconds = sleep_mode.wake(target.base_url)
        except sleep_mode.SleepModeError as err:
            raise sleep_mode.SleepModeError(f"[{target.label}] {err}") from err
        self._asleep[target.label] = False
        self._warm.discard(target.label)  # the KV cache was discarded: warm up again (CUDA graphs stay)
        progress.write(f"[{target.label}] awake in {seconds:.1f} s")
        return round(seconds, 3)

    def release(self, label: str) -> None:
        """Called after each slot; servers that stay up do nothing."""

    def close(self) -> None:
        """Stop what was started."""


class UrlServers(ServerSet):
    """Servers that already run: one per label (``--url`` repeated, with ``--label``)."""

    def __init__(self, settings: Settings, targets: list[Target]):
        super().__init__(settings)
        self.targets = {t.label: t for t in targets}
        self.info = {t.label: {"url": t.base_url, "log_path": t.log_path} for t in targets}

    def _target(self, label: str, progress: Progress) -> Target:
        return self.targets[label]

    def _up(self) -> dict[str, Target]:
        return self.targets

    def close(self) -> None:
        asleep = [label for label, state in self._asleep.items() if state]
        if asleep:  # waking them all could need more GPU memory than there is
            print(f"left asleep: {', '.join(asleep)} (POST /wake_up wakes a server)", flush=True)


@dataclass
class LaunchSpec:
    """How to launch the servers of ``--launch``: one per label, ``sections[label]`` being its
    whole ``boundary_checkpoints`` section."""

    model_dir: str
    model_name: str
    sections: dict[str, dict]
    host: str = "127.0.0.1"
    port: int | None = None  # the first server's port (the others follow); default: free ports
    server_args: list[str] = field(default_factory=list)
    label_args: dict[str, list[str]] = field(default_factory=dict)  # extra flags of one label, after server_args
    additional_config: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bc-bench-")))
    startup_timeout: float = 900.0
    relaunch: bool = False  # one server at a time, started for each slot
    # Every server up at once, but each started only once the previous one is healthy: vLLM's
    # memory profile counts what other processes take on the GPU while it profiles, so servers
    # that start together on one GPU can each find no room left for their KV cache.
    one_by_one: bool = False
    keep_file: Path | None = None  # with sleep_others: servers kept for the next run (kept_servers)


class LaunchedServers(ServerSet):
    """vLLM servers started by the benchmark (``--launch``)."""

    def __init__(self, settings: Settings, spec: LaunchSpec):
        super().__init__(settings)
        self.spec = spec
        self.running: dict[str, Any] = {}
        self.budget: RoundBudget | None = None  # the run's budget: a start waits at most until it ends

    def launch_options(self, label: str) -> tuple[list[str], dict[str, str]]:
        """The extra vLLM flags and environment of ``label``'s server (sleep mode's under
        ``sleep_others``)."""
        spec = self.spec
        extra_args = [*spec.server_args, *spec.label_args.get(label, [])]
        if not self.settings.sleep_others:
            return extra_args, dict(spec.env)
        return [*extra_args, sleep_mode.SLEEP_FLAG], {**spec.env, **sleep_mode.SLEEP_ENV}

    def _start(self, label: str, progress: Progress):
        from bc_tools.bench.server import find_free_port, start_server

        spec = self.spec
        index = self.settings.labels.index(label)
        port = spec.port + index if spec.port else find_free_port(spec.host)
        section = {**(spec.additional_config.get("boundary_checkpoints") or {}), **spec.sections[label],
                   "stats_log_interval_s": self.settings.stats_log_interval}  # fmt: skip
        log_path = spec.log_dir / f"server_{label}.log"
        if spec.keep_file is not None:  # a kept server's log outlives the run: a new server starts a new one
            log_path.unlink(missing_ok=True)
        progress.write(f"[{label}] starting vLLM on {spec.host}:{port} (log {log_path})")
        extra_args, env = self.launch_options(label)
        server = start_server(spec.model_dir, log_path, host=spec.host, port=port, served_model_name=spec.model_name,
                              additional_config={**spec.additional_config, "boundary_checkpoints": section},
                              extra_args=extra_args, env=env, unset_env=(POLICY_ENV,))  # fmt: skip
        self.running[label] = server
        self.info.setdefault(label, {"command": server.command, "log_path": str(log_path), "ready_s": []})
        self._warm.discard(label)
        return server

    def _wait(self, label: str, progress: Progress) -> None:
        from bc_tools.bench.server import ServerStartError, wait_until_healthy

        server = self.running[label]
        left = self.budget.seconds_left() if self.budget is not None else None
        budget_bound = left is not None and left < self.spec.startup_timeout
        try:
            ready = wait_until_healthy(server, timeout=left if budget_bound else self.spec.startup_timeout)
        except ServerStartError as err:
            if budget_bound and server.running():
                raise BudgetEndedDuringStart(label) from err
            raise SystemExit(f"[{label}] server failed to start: {err}") from err
        self.info[label]["ready_s"].append(round(ready, 1))
        self.info[label]["graph_capture"] = logs.graph_capture(logs.read_text(server.log_path))
        progress.write(f"[{label}] ready in {ready:.1f} s")
        s = self.settings
        if s.block_size is None:
            s.block_size, s.block_size_source = logs.resolve_block_size(
                None, logs.read_text(server.log_path), server.command
            )

    def start_all(self, progress: Progress) -> None:
        """Start every server at once, then wait for each; with ``one_by_one``, wait for each before
        starting the next; with ``sleep_others``, also put each but the last to sleep before the
        next starts (nothing here in ``relaunch`` mode)."""
        if self.spec.relaunch:
            return
        labels = self.settings.labels
        if self.spec.one_by_one or self.settings.sleep_others:
            kept = self._kept(progress)
            for label in [label for label in labels if label in kept]:  # first, all asleep: GPU memory
                self._adopt(label, kept[label], progress)  # for the new ones, an empty cache at each first slot
                self._wait(label, progress)
                self._asleep[label] = sleep_mode.is_sleeping(kept[label].base_url)
                if not self._asleep[label]:
                    self.info[label]["startup_sleep"] = self._sleep(self._up()[label], progress)
            new = [label for label in labels if label not in kept]
            for label in new:
                self._start(label, progress)
                self._wait(label, progress)
                if self.settings.sleep_others and label != new[-1]:
                    self.info[label]["startup_sleep"] = self._sleep(self._up()[label], progress)
                elif self.settings.sleep_others:
                    self._asleep[label] = False
                self._save_kept()  # at once: a run killed before close() must not orphan it
            return
        for label in self.settings.labels:
            self._start(label, progress)
        for label in self.settings.labels:
            self._wait(label, progress)

    def _launch_key(self) -> str:
        spec = self.spec
        return kept_servers.launch_key({
            "model_dir": spec.model_dir, "model_name": spec.model_name, "host": spec.host, "port": spec.port,
            "labels": list(self.settings.labels), "stats_log_interval_s": self.settings.stats_log_interval,
            "sections": spec.sections, "additional_config": spec.additional_config, "env": spec.env,
            "launch": {label: self.launch_options(label)[0] for label in self.settings.labels},
        })  # fmt: skip

    def _kept(self, progress: Progress) -> dict[str, Any]:
        """The live servers an earlier run of this launch kept (none without ``keep_file``)."""
        if self.spec.keep_file is None:
            return {}
        kept = kept_servers.adopt(self.spec.keep_file, self._launch_key())
        if kept:
            progress.write(f"kept servers adopted: {', '.join(kept)} ({self.spec.keep_file})")
        return kept

    def _adopt(self, label: str, server: Any, progress: Progress) -> None:
        self.running[label] = server
        self.info.setdefault(label, {"command": server.command, "log_path": str(server.log_path), "ready_s": [],
                                     "kept": True})  # fmt: skip
        progress.write(f"[{label}] kept from an earlier run on {server.base_url} (log {server.log_path})")

    def _save_kept(self) -> None:
        if self.spec.keep_file is not None:
            kept_servers.save(self.spec.keep_file, self._launch_key(), self.running)

    def _target(self, label: str, progress: Progress) -> Target:
        if label not in self.running:
            self._start(label, progress)
            self._wait(label, progress)
        return self._up()[label]

    def _up(self) -> dict[str, Target]:
        return {label: Target(label, server.base_url, self.spec.model_name, str(server.log_path))
                for label, server in self.running.items()}  # fmt: skip

    def _stop(self, label: str) -> None:
        from bc_tools.bench.server import stop_server

        server = self.running.pop(label)
        self._asleep.pop(label, None)
        self.info[label].setdefault("exit_codes", []).append(stop_server(server))
        self.info[label]["boundary_stats"] = logs.parse_boundary_stats(logs.read_text(server.log_path))

    def release(self, label: str) -> None:
        if self.spec.relaunch:
            self._stop(label)

    def close(self) -> None:
        if self.spec.keep_file is not None:  # left running for the next run (kept_servers)
            self._save_kept()
            return
        for label in list(self.running):
            self._stop(label)


def write_logging_config(env: dict[str, str]) -> None:
    """Point ``VLLM_LOGGING_CONFIG_PATH`` in ``env`` at ``logs.plugin_logging_config`` unless the
    variable is already set there or in this process's environment."""
    if "VLLM_LOGGING_CONFIG_PATH" in env or os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return
    path = Path(tempfile.mkdtemp(prefix="bc-bench-logging-")) / "logging_config.json"
    path.write_text(json.dumps(logs.plugin_logging_config(), indent=2) + "\n")
    env["VLLM_LOGGING_CONFIG_PATH"] = str(path)
