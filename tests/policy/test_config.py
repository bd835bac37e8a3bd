"""Every knob's default and validation: bad values raise ConfigurationError naming field and rule."""

from __future__ import annotations

from typing import Any

import pytest

from ckptkeeper import CheckpointerCallback, CheckpointPolicyConfig, ConfigurationError, RemovalStrategy


def test_defaults_are_the_specifications() -> None:
    cfg = CheckpointPolicyConfig()
    assert cfg.save_interval == 250
    assert cfg.ephemeral_save_interval is None
    assert cfg.pre_train_checkpoint is None
    assert cfg.save_async is None
    assert cfg.remove == RemovalStrategy.ephemeral_only
    assert cfg.ephemeral_cooldown is None
    assert cfg.fixed_steps is None
    assert cfg.enabled is True


@pytest.mark.parametrize(
    ("kwargs", "field", "rule"),
    [
        ({"save_interval": 0}, "save_interval", "at least 1"),
        ({"save_interval": -5}, "save_interval", "at least 1"),
        ({"save_interval": 2.5}, "save_interval", "integer"),
        ({"ephemeral_save_interval": 0}, "ephemeral_save_interval", "at least 1"),
        ({"save_interval": 10, "ephemeral_save_interval": 10}, "ephemeral_save_interval", "less than"),
        ({"save_interval": 10, "ephemeral_save_interval": 20}, "ephemeral_save_interval", "less than"),
        ({"ephemeral_cooldown": 0}, "ephemeral_cooldown", "at least 1"),
        ({"remove": "sometimes"}, "remove", "one of"),
        ({"fixed_steps": [3, -1]}, "fixed_steps", "non-negative"),
        ({"fixed_steps": ["7"]}, "fixed_steps", "non-negative"),
        ({"pre_train_checkpoint": "yes"}, "pre_train_checkpoint", "True, False or None"),
        ({"save_async": 1}, "save_async", "True, False or None"),
        ({"enabled": None}, "enabled", "True or False"),
    ],
)
def test_invalid_settings_name_field_and_rule(kwargs: dict[str, Any], field: str, rule: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        CheckpointPolicyConfig(**kwargs)
    assert f"'{field}'" in str(info.value)
    assert rule in str(info.value)
    # The callback validates the same way, at construction.
    with pytest.raises(ConfigurationError):
        CheckpointerCallback(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"save_interval": None, "ephemeral_save_interval": 1000},
        {"save_interval": 10, "ephemeral_save_interval": 9},
        {"save_interval": 1},
        {"remove": "never"},
        {"fixed_steps": [0, 5]},
    ],
)
def test_valid_settings_are_accepted(kwargs: dict[str, Any]) -> None:
    cfg = CheckpointPolicyConfig(**kwargs)
    assert isinstance(cfg.remove, RemovalStrategy)


def test_config_is_frozen() -> None:
    cfg = CheckpointPolicyConfig()
    with pytest.raises(AttributeError):
        cfg.save_interval = 3  # type: ignore[misc]


def test_callback_round_trips_a_config() -> None:
    cfg = CheckpointPolicyConfig(save_interval=9, ephemeral_save_interval=3, fixed_steps=(4,), remove="never")
    assert CheckpointerCallback.from_config(cfg).policy == cfg
