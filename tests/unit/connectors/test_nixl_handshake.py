"""The NIXL handshake's compatibility facts: what two pods must share for a
block READ from one to mean the same thing in the other."""

from __future__ import annotations

import dataclasses

from connectors.nixl_handshake import compat_facts, compat_hash, incompatibility
from engine.kv_transfer.base import KVLayout

LAYOUT = KVLayout(
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    block_size=4,
    dtype="float32",
    weight_format="float32",
)


def test_pods_with_different_weight_formats_are_incompatible() -> None:
    """A float32-weights pod and a Q4_1-weights pod compute different KV for
    the same tokens: the handshake refuses the pair and names the format."""
    f32 = compat_facts("m", LAYOUT)
    q4 = compat_facts("m", dataclasses.replace(LAYOUT, weight_format="q4_1+q8_0"))
    assert f32["weight_format"] == "float32"
    assert compat_hash(f32) != compat_hash(q4)
    assert incompatibility(f32, q4) == "weight_format: peer 'q4_1+q8_0', here 'float32'"
    assert incompatibility(f32, compat_facts("m", LAYOUT)) is None
