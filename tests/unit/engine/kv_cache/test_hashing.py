"""Block hashes: a chain over full blocks, identical in every process."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.kv_cache.hashing import NONE_HASH, BlockHasher, hash_block_tokens
from engine.request import Request
from engine.sampling_params import SamplingParams

SNIPPET = (
    "from engine.kv_cache.hashing import hash_block_tokens as h;"
    "print(h(h(None, list(range(16))), list(range(16, 32)), ('salt',)).hex())"
)


def test_hashes_are_identical_across_processes():
    outs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", SNIPPET], capture_output=True, text=True, check=True, env=env
        )
        outs.add(proc.stdout.strip())
    local = hash_block_tokens(
        hash_block_tokens(None, list(range(16))), list(range(16, 32)), ("salt",)
    )
    assert outs == {local.hex()}


def test_chain_depends_on_parent_tokens_and_extra_keys():
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(NONE_HASH, [1, 2, 3])
    assert a != hash_block_tokens(None, [1, 2, 4])
    assert a != hash_block_tokens(None, [1, 2, 3], ("tenant",))
    assert hash_block_tokens(a, [4]) != hash_block_tokens(None, [4])
    assert len(a) == 32


def test_request_hashes_full_blocks_incrementally():
    hasher = BlockHasher(4)
    req = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(), block_hasher=hasher)
    assert len(req.block_hashes) == 1
    req.append_output_token_id(7)
    assert len(req.block_hashes) == 1
    req.append_output_token_id(8)
    assert len(req.block_hashes) == 2
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [5, 6, 7, 8])


def test_cache_salt_isolates_identical_prompts():
    hasher = BlockHasher(4)
    plain = Request("a", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), block_hasher=hasher)
    salted = Request(
        "b", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), cache_salt="t1", block_hasher=hasher
    )
    assert not set(plain.block_hashes) & set(salted.block_hashes)
