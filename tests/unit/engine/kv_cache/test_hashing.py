"""Block hashes: a chain over full blocks, identical in every process."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.kv_cache.hashing import NONE_HASH, BlockHasher, hash_block_tokens, hash_chain
from engine.request import Request
from engine.request_options import RequestOptions
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
        "b",
        [1, 2, 3, 4, 5, 6, 7, 8],
        SamplingParams(),
        options=RequestOptions(cache_salt="t1"),
        block_hasher=hasher,
    )
    assert not set(plain.block_hashes) & set(salted.block_hashes)


def test_a_request_hashes_its_blocks_with_the_one_chain_function():
    """BlockHasher, as a request grows token by token, gives exactly the
    chain hash_chain gives for all its tokens at once (what the router
    computes for a prompt): salted or not."""
    for salt in (None, "t1"):
        hasher = BlockHasher(4)
        options = RequestOptions(cache_salt=salt)
        req = Request("r", list(range(7)), SamplingParams(), options=options, block_hasher=hasher)
        for token in range(7, 20):
            req.append_output_token_id(token)
            assert req.block_hashes == hash_chain(req.all_token_ids, 4, cache_salt=salt)
        assert len(req.block_hashes) == 5


def test_the_chain_goes_on_from_the_hashes_already_known():
    tokens = list(range(40))
    whole = hash_chain(tokens, 8)
    assert len(whole) == 5 and whole[0] == hash_block_tokens(None, tokens[:8])
    assert hash_chain(tokens, 8, whole[:2]) == whole[2:]
    assert hash_chain(tokens, 8, whole) == []
    assert hash_chain(tokens[:7], 8) == []  # a partial block has no hash
    salted = hash_chain(tokens, 8, cache_salt="t1")
    assert salted[0] == hash_block_tokens(None, tokens[:8], ("t1",))
    assert hash_chain(tokens, 8, salted[:1], cache_salt="t1") == salted[1:]


def test_a_lora_key_separates_chains_and_the_router_computes_the_same():
    from engine.lora.request import LoRARequest

    tokens = list(range(12))
    lora = LoRARequest("a", 1, "/a", "lora:" + "ab" * 16)
    request = Request("r", tokens, SamplingParams(), block_hasher=BlockHasher(4))
    adapted = Request("s", tokens, SamplingParams(), lora_request=lora, block_hasher=BlockHasher(4))
    assert request.block_hashes == hash_chain(tokens, 4)
    assert adapted.block_hashes == hash_chain(tokens, 4, lora_key=lora.cache_key)
    assert not set(adapted.block_hashes) & set(request.block_hashes)
    # A salt that spells the key is still another chain.
    assert hash_chain(tokens, 4, cache_salt=lora.cache_key) != adapted.block_hashes
    salted = hash_chain(tokens, 4, cache_salt="t", lora_key=lora.cache_key)
    assert salted != adapted.block_hashes and salted != hash_chain(tokens, 4, cache_salt="t")
