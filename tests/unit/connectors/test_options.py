"""Typed connector options (engine/kv_transfer/options.py): parsing, and each
built-in connector refusing keys it does not take."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

import pytest

from connectors.multi import MultiOptions
from connectors.nixl_connector import NixlOptions
from connectors.redis_connector import RedisOptions
from connectors.shm_connector import ShmOptions
from connectors.store_connector import StoreOptions
from engine.config import ConfigError, KVTransferConfig
from engine.kv_transfer.options import (
    ConnectorOptions,
    SideChannelOptions,
    option,
    refuse_unknown_keys,
)
from engine.kv_transfer.registry import check_connector_config, connector_class, known_connectors


@dataclass(frozen=True)
class SampleOptions(ConnectorOptions):
    name: str = option("a", "a string")
    count: int = option(1, "an int")
    ratio: float = option(0.5, "a float")
    flag: bool = option(False, "a bool")
    limit: float | None = option(None, "a float or null")
    items: list[Any] | None = option(None, "a list or null")


@dataclass(frozen=True)
class RequiredOptions(ConnectorOptions):
    target: str


@dataclass(frozen=True)
class OddOptions(ConnectorOptions):
    when: complex = option(0j, "no option is of this type")


def parse(**extra: Any) -> SampleOptions:
    return SampleOptions.parse(extra, "sample")


def refusal(**extra: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse(**extra)
    return str(info.value)


# ---- the mechanism -----------------------------------------------------------


def test_nothing_given_is_the_defaults() -> None:
    assert parse() == SampleOptions()
    assert parse().count == 1


def test_given_values_are_kept() -> None:
    options = parse(name="b", count=3, flag=True, limit=2.5, items=[1])
    assert (options.name, options.count, options.flag, options.limit) == ("b", 3, True, 2.5)
    assert options.items == [1]


def test_an_unknown_key_is_named_with_the_connector_and_the_keys_it_takes() -> None:
    message = refusal(zzz=1)
    assert message == (
        "kv_connector_extra_config of the 'sample' connector has unknown key 'zzz': "
        "it takes count, flag, items, limit, name, ratio"
    )


def test_a_close_key_is_suggested() -> None:
    assert "unknown key 'cuont' (did you mean 'count'?)" in refusal(cuont=2)


def test_every_unknown_key_is_named() -> None:
    message = refusal(nmae="x", zzz=1, count=2)
    assert "unknown keys 'nmae' (did you mean 'name'?), 'zzz':" in message


def test_the_place_of_the_dict_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^x\.connectors\[1\] of the 'sample' connector"):
        SampleOptions.parse({"zzz": 1}, "sample", "x.connectors[1]")


def test_a_wrong_type_names_the_key_the_value_and_the_type() -> None:
    assert refusal(count="3") == (
        "kv_connector_extra_config of the 'sample' connector: count='3' is invalid: expected an int"
    )
    assert refusal(flag="true").endswith("flag='true' is invalid: expected a bool")
    assert refusal(name=5).endswith("name=5 is invalid: expected a string")
    assert refusal(items={}).endswith("items={} is invalid: expected a list or null")


def test_an_int_is_taken_for_a_float_and_becomes_one() -> None:
    options = parse(ratio=2, limit=3)
    assert options.ratio == 2.0 and isinstance(options.ratio, float)
    assert options.limit == 3.0 and isinstance(options.limit, float)


def test_a_bool_is_not_a_number() -> None:
    assert refusal(count=True).endswith("count=True is invalid: expected an int")
    assert refusal(ratio=False).endswith("ratio=False is invalid: expected a number")
    assert refusal(limit=True).endswith("expected a number or null")


def test_null_only_where_the_type_allows_it() -> None:
    assert parse(limit=None).limit is None
    assert refusal(count=None).endswith("count=None is invalid: expected an int")


def test_a_key_without_a_default_must_be_given() -> None:
    with pytest.raises(ConfigError, match=r"of the 'req' connector lacks 'target'$"):
        RequiredOptions.parse({}, "req")
    assert RequiredOptions.parse({"target": "t"}, "req").target == "t"


def test_an_option_of_an_unsupported_type_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="options cannot be of type"):
        OddOptions.parse({"when": 1j}, "odd")


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse().count = 2  # type: ignore[misc]


def test_of_reads_the_config_and_names_its_connector() -> None:
    config = KVTransferConfig("sample", "kv_both", {"count": 4})
    assert SampleOptions.of(config).count == 4
    with pytest.raises(ConfigError, match="'sample' connector"):
        SampleOptions.of(KVTransferConfig("sample", "kv_both", {"cuont": 4}))


def test_refuse_unknown_keys_passes_known_ones() -> None:
    refuse_unknown_keys("here", ["a"], ["a", "b"])
    with pytest.raises(ConfigError, match=r"^here has unknown key 'c': it takes a, b$"):
        refuse_unknown_keys("here", ["a", "c"], ["a", "b"])


# ---- the built-in connectors ---------------------------------------------------

BUILTIN_OPTIONS = [StoreOptions, RedisOptions, ShmOptions, NixlOptions, MultiOptions]


@pytest.mark.parametrize("cls", BUILTIN_OPTIONS, ids=lambda c: c.__name__)
def test_every_builtin_option_has_a_default_and_a_doc(cls: type[ConnectorOptions]) -> None:
    for f in fields(cls):
        assert f.metadata.get("doc"), f"{cls.__name__}.{f.name}"
    assert cls.parse({}, "x") == cls()


def check(name: str, extra: dict[str, Any]) -> None:
    check_connector_config(KVTransferConfig(name, "kv_both", extra))


def refused(name: str, extra: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        check(name, extra)
    return str(info.value)


@pytest.mark.parametrize(
    ("name", "typo", "meant"),
    [
        ("redis", "key_prefx", "key_prefix"),
        ("redis", "load_asnyc", "load_async"),
        ("shm", "capacity_byte", "capacity_bytes"),
        ("shm", "load_wait_second", "load_wait_seconds"),
        ("nixl", "handshake_timout", "handshake_timeout"),
        ("nixl", "side_channel_prot", "side_channel_port"),
        ("multi", "connector", "connectors"),
    ],
)
def test_each_connector_refuses_a_misspelled_key(name: str, typo: str, meant: str) -> None:
    message = refused(name, {typo: 1})
    assert message.startswith(
        f"kv_connector_extra_config of the {name!r} connector has unknown key {typo!r} "
        f"(did you mean {meant!r}?): it takes "
    )
    assert meant in message.split("it takes ")[1].split(", ")


def test_each_connector_refuses_a_wrong_type() -> None:
    assert refused("redis", {"socket_timeout": "2"}).endswith(
        "socket_timeout='2' is invalid: expected a number"
    )
    assert refused("shm", {"capacity_bytes": 1.5}).endswith("expected an int")
    assert refused("nixl", {"side_channel_port": "7"}).endswith("expected an int")
    assert refused("multi", {"connectors": {}}).endswith("expected a list or null")


def test_what_the_cli_and_the_helm_chart_write_is_taken() -> None:
    """service/cli.py (--kv-offload) and helm/tandem/templates/_helpers.tpl
    write these keys; YAML numbers arrive as ints."""
    check("redis", {"url": "redis://h:1/0", "key_prefix": "p:", "socket_timeout": 2})
    check("redis", {"ttl_seconds": 600, "load_async": True, "load_wait_seconds": 2})
    check("shm", {"pool_name": "tandem", "capacity_bytes": 1 << 30, "load_async": False})
    check("nixl", {"side_channel_host": "$(POD_IP)", "handshake_timeout": 3})
    tiers = [
        {"kv_connector": "shm", "kv_connector_extra_config": {"capacity_bytes": 1 << 20}},
        {"kv_connector": "redis", "kv_connector_extra_config": {"url": "redis://h:1/0"}},
    ]
    check("multi", {"connectors": tiers})


def test_the_side_channel_keys_the_server_adds_are_taken() -> None:
    """with_side_channel adds side_channel_host/port to each connector that
    needs a side channel, a multi connector's tiers included."""
    for name in ("nixl", "multi"):
        extra: dict[str, Any] = {"handshake_timeout": 3}
        if name == "multi":
            extra = {"connectors": [{"kv_connector": "nixl", "kv_connector_extra_config": extra}]}
        config = KVTransferConfig(name, "kv_producer", extra)
        told = connector_class(name).with_side_channel(config, "10.0.0.5", 50061)
        assert "side_channel_port" in str(told.kv_connector_extra_config)
        check_connector_config(told)


def test_a_connector_with_a_side_channel_takes_its_keys() -> None:
    for name in known_connectors():
        cls = connector_class(name)
        if cls.needs_side_channel and cls.options_class is not None:
            assert issubclass(cls.options_class, SideChannelOptions), name


def test_a_tier_is_checked_by_its_own_connector() -> None:
    tiers = [
        {"kv_connector": "shm", "kv_connector_extra_config": {}},
        {"kv_connector": "redis", "kv_connector_extra_config": {"key_prefx": "p:"}},
    ]
    assert refused("multi", {"connectors": tiers}).startswith(
        "kv_connector_extra_config.connectors[1].kv_connector_extra_config of the 'redis' "
        "connector has unknown key 'key_prefx' (did you mean 'key_prefix'?)"
    )


def test_a_tier_entry_refuses_unknown_keys() -> None:
    tier = {"kv_connector": "shm", "kv_connector_extra_confg": {"pool_name": "p"}}
    assert refused("multi", {"connectors": [tier]}) == (
        "kv_connector_extra_config.connectors[0] of the multi connector has unknown key "
        "'kv_connector_extra_confg' (did you mean 'kv_connector_extra_config'?): "
        "it takes kv_connector, kv_connector_extra_config"
    )
    bad_extra = {"kv_connector": "shm", "kv_connector_extra_config": [1]}
    assert refused("multi", {"connectors": [bad_extra]}).endswith("expected an object")
    assert "non-empty list" in refused("multi", {})
