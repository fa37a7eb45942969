"""Supported vLLM versions (``boundary_checkpoints/versions.py``) and what the plugin's entry point
does on another one: nothing of the plugin installed, one ERROR line, and a startup error only
under an explicit ``request_boundaries``. The installed version is monkeypatched, not installed."""

import sys
from types import SimpleNamespace

import pytest
import vllm

from boundary_checkpoints import plugin, versions
from boundary_checkpoints.graph_ceiling import user_set_capture_sizes
from boundary_checkpoints.settings import CONFIG_KEY, ENV_POLICY
from boundary_checkpoints.versions import (
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVLLMVersionError,
    check_vllm_version,
    is_supported_vllm,
)

OFF_LINE = "boundary checkpoints off: vLLM 0.34.0 is not supported (supported: 0.32.0)"


class FakeLogger:
    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def _log(self, level, fmt, *args):
        self.lines.append((level, fmt % args if args else fmt))

    def error(self, fmt, *args):
        self._log("error", fmt, *args)

    def warning(self, fmt, *args):
        self._log("warning", fmt, *args)

    def info(self, fmt, *args):
        self._log("info", fmt, *args)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test logs into its own FakeLogger with an empty once-per-process memory, and leaves
    ``VllmConfig.__post_init__`` and the policy variable as it found them."""
    from vllm.config import VllmConfig

    monkeypatch.setattr(versions, "_logged", set())
    monkeypatch.setattr(VllmConfig, "__post_init__", VllmConfig.__post_init__)
    monkeypatch.delenv(ENV_POLICY, raising=False)
    log = FakeLogger()
    monkeypatch.setattr(plugin, "logger", log)
    return log


def test_supported_list_is_0_32_0_and_the_installed_vllm_is_on_it():
    assert SUPPORTED_VLLM_VERSIONS == ("0.32.0",)
    assert is_supported_vllm(vllm.__version__)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", " 0.32.0+cu130 "])
def test_supported_versions_are_accepted_without_a_log_line(version, fresh_state):
    assert is_supported_vllm(version)
    assert check_vllm_version(version, "request_boundaries", fresh_state) is True
    assert fresh_state.lines == []


@pytest.mark.parametrize("version", ["0.34.0", "0.34.0+cpu", "0.32.1", "0.31.0", "0.32.0rc1", "0.32.0.dev3", "dev", ""])
def test_other_versions_are_refused(version):
    assert not is_supported_vllm(version)


@pytest.mark.parametrize("policy", ["auto", "aligned", None])
def test_unsupported_version_leaves_vllm_stock_with_one_error_line(policy, fresh_state):
    for _ in range(3):
        assert check_vllm_version("0.34.0", policy, fresh_state) is False
    assert len(fresh_state.lines) == 1
    level, line = fresh_state.lines[0]
    assert level == "error" and line.startswith(OFF_LINE), line
    assert "\n" not in line


def test_explicit_request_boundaries_on_unsupported_version_is_a_startup_error(fresh_state):
    with pytest.raises(RuntimeError) as info:
        check_vllm_version("0.34.0", "request_boundaries", fresh_state)
    assert isinstance(info.value, UnsupportedVLLMVersionError)
    message = str(info.value)
    assert "vLLM 0.34.0 is not supported (supported: 0.32.0)" in message
    assert "request_boundaries" in message and "auto" in message
    assert fresh_state.lines == [("error", message)]


def _forbid_compat(monkeypatch):
    """Any import of ``boundary_checkpoints.compat`` (vLLM's internals) now fails."""
    monkeypatch.setitem(sys.modules, "boundary_checkpoints.compat", None)


def _stub_post_init(monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "__post_init__", lambda self: None)
    return VllmConfig


def test_register_on_unsupported_vllm_installs_nothing_and_gates_the_configured_policy(monkeypatch, fresh_state):
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    _forbid_compat(monkeypatch)
    VllmConfig = _stub_post_init(monkeypatch)

    plugin.register()  # must not import compat or install the plugin's classes
    assert fresh_state.lines == []  # the policy is not known before the config is finalized

    def finalize(policy):
        cfg = SimpleNamespace(additional_config={CONFIG_KEY: {"policy": policy}} if policy else None)
        VllmConfig.__post_init__(cfg)
        return cfg

    cfg = finalize("auto")
    assert fresh_state.lines == [("error", fresh_state.lines[0][1])]
    assert fresh_state.lines[0][1].startswith(OFF_LINE)
    assert not hasattr(cfg, "scheduler_config")  # nothing else touched the config
    finalize(None)  # unset: same as auto, same line, not logged again
    assert len(fresh_state.lines) == 1
    with pytest.raises(UnsupportedVLLMVersionError, match="vLLM 0.34.0 is not supported"):
        finalize("request_boundaries")


def test_register_on_unsupported_vllm_with_policy_variable_fails_at_load(monkeypatch, fresh_state):
    monkeypatch.setattr(vllm, "__version__", "0.34.0+cpu")
    _forbid_compat(monkeypatch)
    monkeypatch.setenv(ENV_POLICY, "request_boundaries")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.34\.0\+cpu is not supported \(supported: 0\.32\.0\)"):
        plugin.register()
    monkeypatch.setenv(ENV_POLICY, "auto")
    plugin.register()
    assert [level for level, _ in fresh_state.lines] == ["error", "error"]
    assert fresh_state.lines[1][1].startswith("boundary checkpoints off: vLLM 0.34.0+cpu is not supported")


def test_register_on_supported_vllm_installs_the_config_hook(monkeypatch, fresh_state):
    from boundary_checkpoints import config_hook

    installed = []
    monkeypatch.setattr(config_hook, "install_vllm_config_hook", lambda *a, **k: installed.append((a, k)))
    monkeypatch.setattr(vllm, "__version__", "0.32.0+cpu")
    plugin.register()
    assert installed == [((plugin.apply_policy,), {"remember": user_set_capture_sizes})]
    assert fresh_state.lines == []
