"""Connectors by name (engine/kv_transfer/registry.py: built-ins,
register_connector, the ``tandem.kv_connectors`` entry points) and
KVTransferConfig.from_json."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import ConfigError, KVTransferConfig
from engine.kv_transfer import registry
from engine.kv_transfer.base import ConnectorContext, KVConnectorBase, KVConnectorRole, KVLayout
from engine.kv_transfer.registry import (
    ENTRY_POINT_GROUP,
    UnknownConnectorError,
    check_connector_config,
    connector_class,
    create_connector,
    known_connectors,
    register_connector,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")


def context_for(name: str, **extra: Any) -> ConnectorContext:
    return ConnectorContext(KVTransferConfig(name, "kv_both", extra), "test-model", LAYOUT, "e0")


class NullConnector(KVConnectorBase):
    """Does nothing; remembers what it was built from."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def start_load_kv(self, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """register_connector writes a process-wide table: undo it after each test."""
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))


# ---- built-ins and register_connector ---------------------------------------


def test_unknown_name_lists_the_known_connectors() -> None:
    with pytest.raises(UnknownConnectorError) as info:
        connector_class("no-such-store")
    message = str(info.value)
    assert "'no-such-store'" in message
    assert "'redis'" in message
    assert "'shm'" in message
    assert isinstance(info.value, ValueError)


def test_create_connector_with_unknown_name_raises() -> None:
    with pytest.raises(UnknownConnectorError, match="no-such-store"):
        create_connector(KVConnectorRole.SCHEDULER, context_for("no-such-store"))


def test_builtins_resolve_to_their_classes() -> None:
    from connectors.redis_connector import RedisConnector
    from connectors.shm_connector import SharedMemoryConnector

    assert connector_class("redis") is RedisConnector
    assert connector_class("shm") is SharedMemoryConnector
    assert {"redis", "shm"} <= set(known_connectors())


def test_every_known_connector_loads() -> None:
    """Every name known_connectors() advertises (and UnknownConnectorError
    lists) resolves to a connector class."""
    for name in known_connectors():
        assert issubclass(connector_class(name), KVConnectorBase), name


def test_register_connector() -> None:
    """A registered class is found by name, listed, and built with the role
    and context."""
    register_connector("null-test", NullConnector)
    assert connector_class("null-test") is NullConnector
    assert "null-test" in known_connectors()
    built = create_connector(KVConnectorRole.WORKER, context_for("null-test", x=1))
    assert isinstance(built, NullConnector)
    assert built.role is KVConnectorRole.WORKER
    assert built.context is not None
    assert built.context.config.kv_connector_extra_config == {"x": 1}


def test_registered_name_overrides_builtin() -> None:
    register_connector("redis", NullConnector)
    assert connector_class("redis") is NullConnector


def test_register_connector_by_path_imports_it_when_first_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``"module:Class"`` path is imported only when its name is first
    resolved (as the built-ins are); a path to a missing class fails then."""
    module = f"{__name__}_lazy_{uuid.uuid4().hex[:8]}"
    register_connector("lazy-test", f"{module}:NullConnector")
    assert "lazy-test" in known_connectors()
    assert module not in sys.modules
    fake = type(sys)(module)
    fake.NullConnector = NullConnector  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, fake)
    assert connector_class("lazy-test") is NullConnector
    register_connector("lazy-missing", f"{module}:NoSuchConnector")
    with pytest.raises(AttributeError, match="NoSuchConnector"):
        connector_class("lazy-missing")


def test_the_engine_imports_no_connector_until_one_is_asked_for() -> None:
    """The registry names the built-ins by path: importing it (and the
    engine's connector API) loads no module of ``connectors``."""
    code = (
        "import sys, engine.kv_transfer.registry, engine.core;"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'connectors'];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    root = Path(__file__).resolve().parents[4]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_connector_without_options_class_takes_any_keys() -> None:
    """A third-party connector that declares no options class reads its raw
    dict: nothing in it is refused."""
    register_connector("null-test", NullConnector)
    config = KVTransferConfig("null-test", "kv_both", {"anything": [1], "else": "x"})
    check_connector_config(config)
    built = create_connector(KVConnectorRole.SCHEDULER, context_for("null-test", anything=1))
    assert built.context is not None
    assert built.context.config.kv_connector_extra_config == {"anything": 1}


def test_check_connector_config_refuses_an_unknown_name_or_key() -> None:
    with pytest.raises(UnknownConnectorError, match="no-such-store"):
        check_connector_config(KVTransferConfig("no-such-store"))
    with pytest.raises(ConfigError, match="unknown key 'pool'"):
        check_connector_config(KVTransferConfig("shm", "kv_both", {"pool": "x"}))


# ---- entry points ------------------------------------------------------------


CONNECTOR_MODULE = """
from typing import Any

from engine.kv_transfer.base import KVConnectorBase


class AcmeConnector(KVConnectorBase):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def start_load_kv(self, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class NotAConnector:
    pass


def make_connector():
    return AcmeConnector
"""


@pytest.fixture
def acme_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An installed third-party distribution on sys.path: a module plus a
    ``*.dist-info`` whose entry_points.txt registers connectors. Returns the
    module name (unique per test, so nothing is cached between tests)."""
    module = f"acme_kv_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(CONNECTOR_MODULE)
    dist_info = tmp_path / f"{module}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            f"""\
            [{ENTRY_POINT_GROUP}]
            acme = {module}:AcmeConnector
            acme-bad = {module}:NotAConnector
            acme-func = {module}:make_connector

            [some.other.group]
            acme-elsewhere = {module}:AcmeConnector
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.delitem(sys.modules, module, raising=False)
    yield module
    sys.modules.pop(module, None)
    importlib.invalidate_caches()


def test_entry_point_connector_loads_by_name(acme_package: str) -> None:
    """A connector a package registers in ``tandem.kv_connectors`` is listed,
    resolves by name, and is built by create_connector."""
    assert "acme" in known_connectors()
    assert "acme-elsewhere" not in known_connectors()  # another group
    cls = connector_class("acme")
    assert cls.__name__ == "AcmeConnector"
    assert cls.__module__ == acme_package
    assert issubclass(cls, KVConnectorBase)
    built = create_connector(KVConnectorRole.SCHEDULER, context_for("acme"))
    assert isinstance(built, cls)
    assert built.role is KVConnectorRole.SCHEDULER
    assert built.context is not None and built.context.engine_id == "e0"


def test_unknown_name_lists_entry_point_connectors(acme_package: str) -> None:
    with pytest.raises(UnknownConnectorError, match="'acme'"):
        connector_class("acme-missing")


@pytest.mark.parametrize("name", ["acme-bad", "acme-func"])
def test_entry_point_not_a_connector_class_is_refused(acme_package: str, name: str) -> None:
    """An entry point naming something other than a KVConnectorBase subclass
    (a plain class, a factory function) is refused, naming the target."""
    with pytest.raises(UnknownConnectorError, match="not a KVConnectorBase subclass") as info:
        connector_class(name)
    assert repr(name) in str(info.value)


def test_entry_points_are_gone_with_the_package(tmp_path: Path) -> None:
    """Without the distribution on sys.path the name is unknown again (the
    entry-point fixture above does not leak into other tests)."""
    assert "acme" not in known_connectors()
    with pytest.raises(UnknownConnectorError):
        connector_class("acme")


# ---- KVTransferConfig.from_json ---------------------------------------------


def test_from_json_parses_a_full_config() -> None:
    config = KVTransferConfig.from_json(
        '{"kv_connector": "redis", "kv_role": "kv_consumer",'
        ' "kv_connector_extra_config": {"url": "redis://h:1/0"}}'
    )
    assert config == KVTransferConfig("redis", "kv_consumer", {"url": "redis://h:1/0"})
    assert config.is_consumer and not config.is_producer


def test_from_json_defaults() -> None:
    config = KVTransferConfig.from_json('{"kv_connector": "shm"}')
    assert config.kv_role == "kv_both"
    assert config.kv_connector_extra_config == {}
    assert config.is_producer and config.is_consumer


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ('{"kv_connector": "redis",', r"kv_transfer_config is not valid JSON"),
        ("redis", r"kv_transfer_config is not valid JSON"),
        ("", r"kv_transfer_config is not valid JSON"),
        ('["redis"]', r"kv_transfer_config=.*\[\"redis\"\].* expected a JSON object"),
        ('"redis"', r"expected a JSON object"),
        ("null", r"expected a JSON object"),
        (
            '{"kv_connector": "redis", "kv_rol": "kv_both"}',
            r"unknown keys \['kv_rol'\].*kv_connector.*kv_role",
        ),
        ('{"kv_role": "kv_both"}', r"lacks 'kv_connector'"),
        ("{}", r"lacks 'kv_connector'"),
        (
            '{"kv_connector": "redis", "kv_role": "producer"}',
            r"^kv_role='producer' is invalid: expected kv_producer \| kv_consumer \| kv_both",
        ),
        ('{"kv_connector": ""}', r"^kv_connector='' is invalid"),
        ('{"kv_connector": 5}', r"^kv_connector=5 is invalid"),
        (
            '{"kv_connector": "redis", "kv_connector_extra_config": [1]}',
            r"^kv_connector_extra_config=\[1\] is invalid: expected a JSON object",
        ),
    ],
    ids=[
        "truncated",
        "bare-word",
        "empty",
        "list",
        "string",
        "null",
        "unknown-key",
        "missing-connector",
        "empty-object",
        "bad-role",
        "empty-name",
        "name-not-string",
        "extra-not-object",
    ],
)
def test_from_json_errors_name_the_problem(text: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        KVTransferConfig.from_json(text)
