"""`tandem serve`'s engine flags are generated from the knobs' declaration
(engine/config.py): one flag per knob, with its default and help, read back
into the field it declares."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from typing import Any

import pytest

from engine.config import CacheConfig, EngineConfig, KnobField, ModelConfig, SchedulerConfig
from service import cli
from service.knob_flags import ENGINE_KNOBS, knob, knob_values


def _serve() -> argparse.ArgumentParser:
    (sub,) = [a for a in cli._parser()._actions if a.dest == "command"]
    parser: argparse.ArgumentParser = sub.choices["serve"]  # type: ignore[index]
    return parser


def _action(flag: str) -> argparse.Action:
    (action,) = [a for a in _serve()._actions if flag in a.option_strings]
    return action


def test_every_knob_is_one_serve_flag_with_its_declared_help_and_default() -> None:
    flags = [k.flag for k in ENGINE_KNOBS]
    assert len(set(flags)) == len(flags)
    for k in ENGINE_KNOBS:
        action = _action(k.flag)
        assert action.help is not None and action.help.startswith(k.knob.help), k.flag
        assert k.default_text, f"{k.flag}: a None default says what it means (unset=)"
        if not k.negated:
            assert action.help.endswith(f"(default: {k.default_text})"), k.flag
        if k.choices:
            assert list(action.choices or ()) == list(k.choices), k.flag
        override = getattr(EngineConfig(), k.section) is None
        if not override and k.type is not bool:
            assert action.default == k.default, k.flag


def test_no_flags_give_the_declared_defaults() -> None:
    config = cli.engine_config_from_args(_serve().parse_args([]))
    assert config.model == ModelConfig()
    assert config.scheduler == SchedulerConfig()
    # Serving records KV events unless --no-kv-events (a service default).
    assert config.cache == replace(CacheConfig(), enable_kv_events=True)
    assert (config.kv_transfer, config.lora, config.speculative) == (None, None, None)


def _argv(k: KnobField) -> tuple[list[str], Any]:
    """Flags that set ``k`` to a value other than its default, and that value."""
    if k.type is bool:
        return [k.flag], not k.default
    if k.many:
        return [k.flag, "8", "24"], (8, 24)
    if k.choices:
        choice = next(c for c in k.choices if c != k.default)
        return [k.flag, choice], choice
    if k.knob.size:
        return [k.flag, "1G"], 2**30
    if k.name == "chat_template":  # a file that exists, or the template itself
        return [k.flag, "{{ messages[0]['content'] }}"], "{{ messages[0]['content'] }}"
    if k.type is str:
        return [k.flag, "/models/m"], "/models/m"
    if k.type is float:
        return [k.flag, str(k.default / 2)], k.default / 2
    value = 2 * k.default if k.default else 2048
    return [k.flag, str(value)], value


# Knobs that are checked against another: that one's flags too.
_ALONG = {"max_long_partial_prefills": ["--max-num-partial-prefills", "4"]}


@pytest.mark.parametrize("k", ENGINE_KNOBS, ids=[k.flag for k in ENGINE_KNOBS])
def test_each_flag_reaches_its_field(k: KnobField) -> None:
    argv, value = _argv(k)
    argv += _ALONG.get(k.name, [])
    if k.section == "kv_transfer":
        argv += ["--kv-offload", "shm"]
    if k.section == "lora":
        argv += ["--enable-lora"]
    config = cli.engine_config_from_args(_serve().parse_args(argv))
    assert getattr(getattr(config, k.section), k.name) == value


def test_only_declared_fields_are_knobs() -> None:
    """Fields the engine sets itself (num_blocks, the scheduler's
    max_model_len placeholder, lookahead slots) are not flags."""
    declared = {(k.section, k.name) for k in ENGINE_KNOBS}
    assert ("scheduler", "max_model_len") not in declared
    assert ("cache", "num_blocks") not in declared
    assert ("model", "max_model_len") in declared
    for section in ("model", "scheduler", "cache"):
        cls = type(getattr(EngineConfig(), section))
        assert {(section, f.name) for f in fields(cls)} & declared


def test_knob_values_reads_only_what_was_given() -> None:
    args = _serve().parse_args(["--max-loras", "2"])
    assert knob_values(args, "lora") == {"max_loras": 2}
    assert knob_values(args, "kv_transfer") == {}
    assert knob("lora", "max_loras").default == 4
