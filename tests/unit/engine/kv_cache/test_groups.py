"""KVCacheGroups: how layers with sliding windows split into block tables."""

from __future__ import annotations

import pytest

from engine.kv_cache.groups import KVCacheGroups, blocks_held

# Gemma 3 270M: 18 layers, every 6th global, the others a 512-token window.
GEMMA_270M = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))


def test_gemma_270m_splits_into_one_full_and_five_windowed_groups_of_three():
    groups = KVCacheGroups.plan(GEMMA_270M, free_windowed=True)
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.layers_per_group == 3
    # The global layers (5, 11, 17) share group 0, one slot each.
    assert [groups.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [groups.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    # Every (group, slot) pair names one layer: no two layers share memory.
    pairs = set(zip(groups.layer_group, groups.layer_slot, strict=True))
    assert len(pairs) == 18
    for g, window in enumerate(groups.windows):
        layers = [i for i in range(18) if groups.layer_group[i] == g]
        assert all(GEMMA_270M[i] == window for i in layers)


def test_uneven_counts_leave_slots_unused_in_the_last_group():
    windows = (None, None, 8, 8, 8)  # 2 full, 3 windowed: groups of 2
    groups = KVCacheGroups.plan(windows, free_windowed=True)
    assert groups.windows == (None, 8, 8)
    assert groups.layers_per_group == 2
    assert groups.layer_group == (0, 0, 1, 1, 2)
    assert groups.layer_slot == (0, 1, 0, 1, 0)


def test_one_kind_of_layer_is_one_group():
    assert KVCacheGroups.plan((None,) * 4, True) == KVCacheGroups.single(4)
    mistral = KVCacheGroups.plan((4096,) * 4, True)
    assert mistral.windows == (4096,) and mistral.layers_per_group == 4


def test_without_freeing_every_layer_keeps_every_block():
    groups = KVCacheGroups.plan(GEMMA_270M, free_windowed=False)
    assert groups.windows == (None,)
    assert groups.layers_per_group == 18
    assert not groups.frees_windowed


def test_blocks_held_caps_a_windowed_group_at_its_window_and_a_chunk():
    assert blocks_held(4096, 16, None, 256) == 256
    # 511 tokens behind the chunk's start, the 256-token chunk, a partial
    # block at each end.
    assert blocks_held(4096, 16, 512, 256) == 49
    assert blocks_held(100, 16, 512, 256) == 7  # short requests: all of it


def test_a_group_without_layers_is_refused():
    with pytest.raises(ValueError, match="every group needs a layer"):
        KVCacheGroups((None, 8), (0, 0), (0, 1))
