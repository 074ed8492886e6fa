"""``engine``'s exports (what the service imports) all resolve."""

from __future__ import annotations

import importlib

import pytest

import engine


def test_every_export_resolves_to_its_module_s_object() -> None:
    for name in engine.__all__:
        value = getattr(engine, name)
        module = importlib.import_module(engine._EXPORTS[name])
        assert value is getattr(module, name), name


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        engine.Nope  # noqa: B018
