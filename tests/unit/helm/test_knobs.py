"""The chart's engine settings agree with the engine's knobs, which are
declared once (engine/config.py `knob`): every engine key is a `tandem serve`
flag and renders as that flag; the schema's types, enums and values.yaml's
defaults (set, or shown commented out) are the declared ones; the tables in
helm/README.md and docs/serving.md are what `python -m service.knob_docs`
writes; each pool's kv_role is the one its role stands for (engine.pod_role).

Adding a knob needs no edit here: a new chart key is checked as it appears."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python as helm
import jsonschema
import pytest

from engine.config import KnobField
from engine.pod_role import kv_role_of
from service import cli, knob_docs
from service.knob_flags import ENGINE_KNOBS, parse_size
from tests.unit.helm.chart import CHART_DIR, FULLNAME, expanded_args, render, tandem_workloads

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
ENGINE_SCHEMA: dict[str, Any] = SCHEMA["definitions"]["engine"]["properties"]
FLAG_KEYS = [k for k in ENGINE_SCHEMA if k not in knob_docs.CHART_OWN_ENGINE_KEYS]
KNOBS_BY_FLAG = {k.flag: k for k in ENGINE_KNOBS}


def _flag(key: str) -> str:
    return "--" + re.sub(r"(?<=[a-z0-9])([A-Z])", r"-\1", key).lower()


def _serve_actions() -> dict[str, Any]:
    args = cli._parser().parse_args(["serve"])
    assert args.command == "serve"
    (sub,) = [a for a in cli._parser()._actions if a.dest == "command"]
    serve = sub.choices["serve"]  # type: ignore[index]
    return {opt: action for action in serve._actions for opt in action.option_strings}


def _exposed() -> list[tuple[str, KnobField]]:
    """(chart key, knob) of every knob the chart sets."""
    out = [(key, KNOBS_BY_FLAG[_flag(key)]) for key in FLAG_KEYS if _flag(key) in KNOBS_BY_FLAG]
    for k in ENGINE_KNOBS:
        if k.name in knob_docs.CHART_KV_TRANSFER_KEYS:
            out.append((knob_docs.CHART_KV_TRANSFER_KEYS[k.name], k))
    return out


def _sample(k: KnobField) -> tuple[Any, Any]:
    """A value other than the default, as a chart value and as the field's."""
    if k.type is bool:
        return (not k.default, not k.default) if not k.negated else (True, False)
    if k.many:
        return [8, 24], (8, 24)
    if k.choices:
        choice = next(c for c in k.choices if c != k.default)
        return choice, choice
    if k.knob.size:
        return "1G", 2**30
    if k.type is int:
        value = 2 * k.default if k.default else 2048
        return value, value
    if k.type is float:
        return k.default / 2, k.default / 2
    if k.type is str:  # chatTemplate: the template itself, lines and quotes included
        text = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        return text, text
    raise AssertionError(f"{k.flag}: no sample for {k.type}")


def _schema_of(chart_key: str) -> dict[str, Any]:
    if chart_key.startswith("kvTransfer."):
        prop: dict[str, Any] = SCHEMA["properties"]["kvTransfer"]["properties"][
            chart_key.removeprefix("kvTransfer.")
        ]
        return prop
    return dict(ENGINE_SCHEMA[chart_key])


def test_every_engine_key_is_a_serve_flag() -> None:
    actions = _serve_actions()
    for key in FLAG_KEYS:
        assert _flag(key) in actions, f"engine.{key}: tandem serve has no {_flag(key)}"
        assert knob_docs.chart_key(_flag(key)) == key
    assert {key for key, _ in _exposed()} >= {"maxNumSeqs", "kvTransfer.leaseSeconds"}


# Keys whose sample contradicts the others' (exact beside int8Activations:
# true and a kvCacheDtype other than dtype's is refused): rendered alone.
ALONE = ("exact",)


@pytest.mark.parametrize("alone", [False, True], ids=["together", "alone"])
def test_each_key_renders_as_its_flag_and_reaches_its_field(alone: bool) -> None:
    values: dict[str, Any] = {"engine": {}, "kvTransfer": {}}
    want = {}
    for key, k in _exposed():
        if (key in ALONE) != alone:
            continue
        chart_value, field_value = _sample(k)
        section, _, name = key.rpartition(".")
        values[section or "engine"][name] = chart_value
        want[(k.section, k.name)] = field_value
    objects = render(values)
    for deployment, c in tandem_workloads(objects):
        args = cli._parser().parse_args(expanded_args(objects, c))
        if args.command != "serve":
            continue
        config = cli.engine_config_from_args(args)
        for (section, name), value in want.items():
            got = getattr(getattr(config, section), name)
            assert got == value, (deployment["metadata"]["name"], section, name)


def test_the_schema_has_the_declared_types_and_choices() -> None:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string"}
    for key, k in _exposed():
        prop = _schema_of(key)
        if k.choices:
            # kvTransfer's "" is the chart's own "unset".
            assert [c for c in prop["enum"] if c != ""] == list(k.choices), key
        elif k.knob.size:
            assert prop["type"] == "string", key
            for text in ("2G", "512M", "1048576"):
                jsonschema.validate(text, prop)
                assert parse_size(text) > 0
        elif k.many:
            assert prop["type"] == "array", key
            assert prop["items"]["type"] == kinds[k.type], key
        else:
            assert prop["type"] == kinds[k.type], key
        if k.default is not None:
            jsonschema.validate(k.default, prop)


def _engine_block_comments() -> dict[str, tuple[str, str]]:
    """values.yaml's commented-out engine keys: key -> (value, trailing comment)."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    start = lines.index("engine:")
    end = next(i for i in range(start + 1, len(lines)) if re.match(r"^\S", lines[i]))
    out = {}
    for line in lines[start + 1 : end]:
        m = re.match(r"^  # (\w+): (\S+)\s*(?:#\s*(.*))?$", line)
        if m and m.group(1) in ENGINE_SCHEMA:
            out[m.group(1)] = (m.group(2), m.group(3) or "")
    return out


def test_values_yaml_shows_each_keys_default() -> None:
    """Each flag key is set to the server's default or shown commented out
    with it (any example where the default is None: the model's, the
    device's); a list of choices in its comment is the declared one."""
    with helm.Chart.load(CHART_DIR) as chart:
        engine = chart.merge_values({})["engine"]
    comments = _engine_block_comments()
    actions = _serve_actions()
    for key in FLAG_KEYS:
        flag = _flag(key)
        k = KNOBS_BY_FLAG.get(flag)
        default = k.default if k is not None else actions[flag].default
        if key in engine:
            assert engine[key] == default, f"values.yaml engine.{key}"
            continue
        assert key in comments, f"values.yaml: engine.{key} neither set nor shown"
        text, note = comments[key]
        if default is not None:
            shown = helm.values_from_yaml(f"v: {text}")["v"]
            assert shown == default, f"values.yaml shows engine.{key}: {text}, not {default}"
        if k is not None and "|" in note:
            listed = re.match(r"^([\w.]+(?:\s*\|\s*[\w.]+)+)", note)
            assert listed, note
            assert [c.strip() for c in listed.group(1).split("|")] == list(k.choices), key


def test_unset_kv_transfer_values_leave_the_servers_defaults() -> None:
    objects = render()
    for _, c in tandem_workloads(objects):
        args = expanded_args(objects, c)
        for flag in ("--kv-load-failure-policy", "--kv-lease-seconds", "--kv-transfer-timeout"):
            assert flag not in args


def test_the_knob_tables_are_fresh() -> None:
    stale = [str(p.relative_to(knob_docs.ROOT)) for p in knob_docs.stale()]
    assert not stale, f"{stale}: run python -m service.knob_docs"


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_each_pools_kv_role_is_the_one_its_role_stands_for(pool: str) -> None:
    objects = render()
    ((_, c),) = [
        (d, c)
        for d, c in tandem_workloads(objects)
        if d["metadata"]["name"] == f"{FULLNAME}-{pool}"
    ]
    args = c["args"]
    assert args[args.index("--role") + 1] == pool
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == kv_role_of(pool)
