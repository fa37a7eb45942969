"""vLLM's sleep mode seen from ``bc-bench --sleep-others``: put a server to sleep, wake it, check it.

Contract: ``put_to_sleep`` sends ``POST /sleep?level=1`` (vLLM offloads the weights to CPU RAM,
discards the KV cache and resets the prefix cache) and ``wake`` sends ``POST /wake_up``; both then
poll ``GET /is_sleeping`` until it says so (``wake`` also until ``/health`` answers 200) and return
the seconds the switch took. The endpoints exist only on a server started with
``--enable-sleep-mode`` (``SLEEP_FLAG``) and the environment variable ``VLLM_SERVER_DEV_MODE=1``
(``SLEEP_ENV``); a 404, another HTTP error, a connection error or a timeout raises
:class:`SleepModeError`, whose message names what to fix. ``sleep_memory`` reads the worker's
"Sleep mode freed X GiB memory, Y GiB memory is still in use" line from a server log.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

from bc_tools.bench.server import is_healthy

SLEEP_FLAG = "--enable-sleep-mode"
SLEEP_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM registers /sleep, /wake_up, /is_sleeping only then
SLEEP_LEVEL = 1
SWITCH_TIMEOUT_S = 300.0  # a sleep copies every weight to CPU RAM, a wake copies them back
POLL_S = 0.1
FREED_LINE = re.compile(r"Sleep mode freed (?P<freed>[\d.]+) GiB memory, (?P<in_use>[\d.]+) GiB memory is still in use")


class SleepModeError(RuntimeError):
    """A server could not be put to sleep or woken (see the module docstring)."""


def _call(method: str, url: str, timeout: float) -> object:
    """The JSON answer of ``method url``; SleepModeError on an HTTP or connection error."""
    request = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as err:
        if err.code == 404:
            raise SleepModeError(
                f"{url} answered 404: the server has no sleep-mode endpoints; start vLLM with "
                f"{SLEEP_FLAG} and the environment variable VLLM_SERVER_DEV_MODE=1 "
                "(bc-bench --launch --sleep-others does both)"
            ) from err
        raise SleepModeError(f"{method} {url} answered HTTP {err.code}: {err.read()[:300]!r}") from err
    except (urllib.error.URLError, OSError) as err:
        raise SleepModeError(f"{method} {url} failed: {err}") from err
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def is_sleeping(base_url: str, timeout: float = 10.0) -> bool:
    """``GET /is_sleeping``'s answer (``{"is_sleeping": bool}``)."""
    answer = _call("GET", f"{base_url}/is_sleeping", timeout)
    if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
        raise SleepModeError(f"{base_url}/is_sleeping answered {answer!r}, not {{'is_sleeping': true|false}}")
    return answer["is_sleeping"]


def _wait_for(base_url: str, asleep: bool, deadline: float, what: str) -> None:
    while True:
        if is_sleeping(base_url) == asleep and (asleep or is_healthy(base_url, timeout=5.0)):
            return
        if time.monotonic() > deadline:
            raise SleepModeError(f"{base_url}: {what} did not finish in {SWITCH_TIMEOUT_S:g} s")
        time.sleep(POLL_S)


def put_to_sleep(base_url: str, timeout: float = SWITCH_TIMEOUT_S) -> float:
    """``POST /sleep?level=1``, then wait until ``/is_sleeping`` says true; the seconds it took."""
    start = time.monotonic()
    _call("POST", f"{base_url}/sleep?level={SLEEP_LEVEL}", timeout)
    _wait_for(base_url, True, start + timeout, "sleep")
    return time.monotonic() - start


def wake(base_url: str, timeout: float = SWITCH_TIMEOUT_S) -> float:
    """``POST /wake_up``, then wait until ``/is_sleeping`` says false and ``/health`` answers 200;
    the seconds it took."""
    start = time.monotonic()
    _call("POST", f"{base_url}/wake_up", timeout)
    _wait_for(base_url, False, start + timeout, "wake-up")
    return time.monotonic() - start


def sleep_memory(log_text: str) -> dict[str, float] | None:
    """The last "Sleep mode freed ..." line of ``log_text`` as ``{"freed_gib", "gpu_in_use_gib"}``
    (the GPU's use by every process after the sleep), or None."""
    matches = list(FREED_LINE.finditer(log_text))
    if not matches:
        return None
    return {"freed_gib": float(matches[-1]["freed"]), "gpu_in_use_gib": float(matches[-1]["in_use"])}
