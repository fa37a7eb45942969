"""BoundaryConfig parsing (``settings.py``): the ``boundary_checkpoints`` section and the policy
environment variable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from boundary_checkpoints.settings import (
    CONFIG_KEY,
    ENV_POLICY,
    POLICIES,
    BoundaryConfig,
    BoundaryConfigError,
)

NO_ENV: dict[str, str] = {}


def parse(section, env=NO_ENV) -> BoundaryConfig:
    return BoundaryConfig.from_additional_config({CONFIG_KEY: section}, env=env)


# --------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("additional_config", [None, {}, {"other_plugin": {"x": 1}}, {CONFIG_KEY: {}}])
def test_defaults(additional_config):
    cfg = BoundaryConfig.from_additional_config(additional_config, env=NO_ENV)
    assert cfg == BoundaryConfig()
    assert (cfg.policy, cfg.max_retained_fraction, cfg.stats_log_interval_s) == ("auto", 0.25, 30.0)
    assert cfg.prompt_checkpoints is True
    assert cfg.prompt_checkpoint_min_tokens == 0
    assert cfg.prompt_capture == "auto"
    assert cfg.prompt_admission == "auto"
    assert cfg.shared_hits_together == "auto"
    assert cfg.graph_fit_tokens == "auto"


@pytest.mark.parametrize("value", ["auto", True, False])
def test_shared_hits_together_takes_auto_or_a_flag(value):
    assert parse({"shared_hits_together": value}).shared_hits_together == value


def test_public_constants():
    assert POLICIES == ("auto", "aligned", "request_boundaries")
    assert CONFIG_KEY == "boundary_checkpoints"
    assert ENV_POLICY == "VLLM_BOUNDARY_CHECKPOINTS_POLICY"
    assert issubclass(BoundaryConfigError, ValueError)


def test_all_fields_parsed():
    cfg = parse(
        {
            "policy": "request_boundaries",
            "max_retained_fraction": 1,
            "stats_log_interval_s": 0,
            "prompt_checkpoints": False,
            "prompt_checkpoint_min_tokens": 512,
            "prompt_capture": "stop",
            "prompt_admission": "all",
        }
    )
    assert cfg.prompt_admission == "all"
    assert cfg.prompt_checkpoints is False
    assert cfg.prompt_capture == "stop"
    assert cfg.prompt_checkpoint_min_tokens == 512
    assert cfg.policy == "request_boundaries"
    assert cfg.max_retained_fraction == 1.0 and isinstance(cfg.max_retained_fraction, float)
    assert cfg.stats_log_interval_s == 0.0 and isinstance(cfg.stats_log_interval_s, float)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_accepted(policy):
    assert parse({"policy": policy}).policy == policy


BAD_VALUES = [
    ("policy", "fast", "auto, aligned, request_boundaries"),
    ("policy", "AUTO", "auto, aligned, request_boundaries"),
    ("policy", 1, "auto, aligned, request_boundaries"),
    ("policy", None, "auto, aligned, request_boundaries"),
    ("max_retained_fraction", 0, "(0, 1]"),
    ("max_retained_fraction", 0.0, "(0, 1]"),
    ("max_retained_fraction", -0.1, "(0, 1]"),
    ("max_retained_fraction", 1.5, "(0, 1]"),
    ("max_retained_fraction", float("nan"), "(0, 1]"),
    ("max_retained_fraction", True, "(0, 1]"),
    ("max_retained_fraction", "0.5", "(0, 1]"),
    ("max_retained_fraction", None, "(0, 1]"),
    ("stats_log_interval_s", -1, ">= 0"),
    ("stats_log_interval_s", float("inf"), ">= 0"),
    ("stats_log_interval_s", False, ">= 0"),
    ("stats_log_interval_s", "30", ">= 0"),
    ("stats_log_interval_s", [30], ">= 0"),
    ("prompt_checkpoints", 1, "true or false"),
    ("prompt_checkpoints", "false", "true or false"),
    ("prompt_checkpoints", None, "true or false"),
    ("prompt_checkpoint_min_tokens", -1, "integer >= 0"),
    ("prompt_checkpoint_min_tokens", 1.5, "integer >= 0"),
    ("prompt_checkpoint_min_tokens", True, "integer >= 0"),
    ("prompt_checkpoint_min_tokens", "512", "integer >= 0"),
    ("prompt_capture", "always", "auto, in_step, stop"),
    ("prompt_capture", True, "auto, in_step, stop"),
    ("prompt_capture", None, "auto, in_step, stop"),
    ("prompt_admission", "sample", "auto, all"),
    ("prompt_admission", True, "auto, all"),
    ("shared_hits_together", "on", '"auto", true or false'),
    ("shared_hits_together", 1, '"auto", true or false'),
    ("shared_hits_together", None, '"auto", true or false'),
    ("graph_fit_tokens", -1, '"auto" or an integer >= 0'),
    ("graph_fit_tokens", True, '"auto" or an integer >= 0'),
    ("graph_fit_tokens", "512", '"auto" or an integer >= 0'),
]


@pytest.mark.parametrize(("key", "value", "allowed"), BAD_VALUES)
def test_bad_value_names_key_and_allowed(key, value, allowed):
    with pytest.raises(BoundaryConfigError) as info:
        parse({key: value})
    message = str(info.value)
    assert f"boundary_checkpoints.{key}" in message
    assert allowed in message


@pytest.mark.parametrize(("key", "value", "allowed"), BAD_VALUES)
def test_direct_construction_validates_too(key, value, allowed):
    with pytest.raises(BoundaryConfigError, match=rf"boundary_checkpoints\.{key}"):
        BoundaryConfig(**{key: value})


def test_unknown_key_names_key_and_lists_allowed():
    with pytest.raises(BoundaryConfigError) as info:
        parse({"policy": "auto", "max_retained_fractoin": 0.5})
    message = str(info.value)
    assert "boundary_checkpoints.max_retained_fractoin" in message
    for key in ("policy", "max_retained_fraction", "stats_log_interval_s"):
        assert key in message


@pytest.mark.parametrize("section", ["auto", ["policy"], 3, True])
def test_non_dict_section_rejected(section):
    with pytest.raises(BoundaryConfigError, match="boundary_checkpoints must be a dict"):
        parse(section)


def test_non_dict_additional_config_rejected():
    with pytest.raises(BoundaryConfigError, match="additional_config must be a dict"):
        BoundaryConfig.from_additional_config("boundary_checkpoints", env=NO_ENV)


def test_config_is_frozen():
    cfg = BoundaryConfig()
    with pytest.raises(AttributeError):
        cfg.policy = "aligned"  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------
# Environment override
# --------------------------------------------------------------------------------------------------


def test_env_overrides_section_policy():
    env = {ENV_POLICY: "aligned"}
    cfg = parse({"policy": "request_boundaries", "max_retained_fraction": 0.5}, env=env)
    assert cfg.policy == "aligned"
    assert cfg.max_retained_fraction == 0.5


def test_env_applies_without_section():
    assert BoundaryConfig.from_additional_config(None, env={ENV_POLICY: "request_boundaries"}).policy == (
        "request_boundaries"
    )


def test_empty_env_is_ignored():
    assert parse({"policy": "aligned"}, env={ENV_POLICY: ""}).policy == "aligned"


@pytest.mark.parametrize("value", ["bogus", "Aligned", " auto"])
def test_bad_env_value_names_env_var(value):
    with pytest.raises(BoundaryConfigError) as info:
        parse({"policy": "auto"}, env={ENV_POLICY: value})
    message = str(info.value)
    assert ENV_POLICY in message
    assert "auto, aligned, request_boundaries" in message


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv(ENV_POLICY, "aligned")
    assert BoundaryConfig.from_additional_config(None).policy == "aligned"
    monkeypatch.setenv(ENV_POLICY, "nope")
    with pytest.raises(BoundaryConfigError, match=ENV_POLICY):
        BoundaryConfig.from_additional_config(None)
    monkeypatch.delenv(ENV_POLICY)
    assert BoundaryConfig.from_additional_config(None).policy == "auto"


def test_for_engine_reads_the_engine_additional_config():
    """``for_engine`` is ``from_additional_config`` of an engine's ``additional_config`` (absent or
    ``None``: the defaults)."""
    engine = SimpleNamespace(additional_config={CONFIG_KEY: {"policy": "aligned", "max_retained_fraction": 0.5}})
    assert BoundaryConfig.for_engine(engine, env=NO_ENV) == parse({"policy": "aligned", "max_retained_fraction": 0.5})
    assert BoundaryConfig.for_engine(SimpleNamespace(additional_config=None), env=NO_ENV) == BoundaryConfig()
    assert BoundaryConfig.for_engine(SimpleNamespace(), env=NO_ENV) == BoundaryConfig()
    assert BoundaryConfig.for_engine(engine, env={ENV_POLICY: "request_boundaries"}).policy == "request_boundaries"
    with pytest.raises(BoundaryConfigError, match=r"boundary_checkpoints\.policy"):
        BoundaryConfig.for_engine(SimpleNamespace(additional_config={CONFIG_KEY: {"policy": "fast"}}), env=NO_ENV)
