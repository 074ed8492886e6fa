"""Greedy outputs of the LLM API on tiny random models of each family added
after Llama/Mistral/Qwen2 (Qwen3, Granite, Phi-3, SmolLM3, Gemma 3 with a
6-token window under its prompts: see
tests/unit/engine/models/families.py) are token-identical to transformers'
own model, in float32 over 32 tokens on 4 prompts: once with chunked
prefill and prefix caching, once with a KV cache small enough to preempt.
On the exact path, said explicitly (float weights run it by default anyway)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GraniteConfig, PreTrainedTokenizerBase

from engine.config import SpeculativeConfig
from engine.kv_cache.groups import KVCacheGroups, blocks_held
from engine.llm import LLM
from engine.models.spec import ModelSpec
from engine.sampling_params import SamplingParams
from kernels import cpu_kernels
from tests.unit.engine.models.families import (
    TINY_SHAPE,
    TINY_VOCAB,
    architecture_name,
    family_configs,
    randomize_weights,
)

MAX_TOKENS = 32
SHARED_PREFIX = 16  # one 16-token block every prompt starts with
PROMPT_TAILS = (2, 9, 1, 6)


def _configs() -> dict[str, Any]:
    configs: dict[str, Any] = family_configs(TINY_SHAPE)
    # Granite without residual_multiplier, at head_dim 64: plain layers the
    # compiled decode stack runs (with Granite's attention scale; the
    # embedding multiplier and logit divisor apply around it).
    configs["granite-decode-stack"] = GraniteConfig(
        **{**TINY_SHAPE, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
        embedding_multiplier=3.0,
        attention_multiplier=0.2,
        logits_scaling=4.0,
    )
    return configs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(TINY_VOCAB) for _ in range(SHARED_PREFIX)]
    return [prefix + [rng.randrange(TINY_VOCAB) for _ in range(n)] for n in PROMPT_TAILS]


@pytest.fixture(scope="module", params=list(_configs()))
def family(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
) -> tuple[Path, list[list[int]]]:
    """(saved model directory, transformers' greedy tokens for each prompt)."""
    config = _configs()[request.param]
    config.architectures = [architecture_name(config)]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, attn_implementation="eager", dtype=torch.float32
    )
    randomize_weights(hf)
    hf.eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)  # the LLM API wants one; token ids < TINY_VOCAB decode
    return path, [_hf_greedy(hf, p) for p in prompts]


def _hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = hf(input_ids=torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(o.finished for o in outs)
    return [o.token_ids for o in outs]


def test_chunked_prefill_and_prefix_caching(family, prompts):
    path, expected = family
    llm = LLM(str(path), enable_prefix_caching=True, max_num_batched_tokens=16, exact=True)
    assert min(len(p) for p in prompts) > 16  # every prefill spans several steps
    assert _generate(llm, prompts[:1]) == expected[:1]  # warms the cache
    assert _generate(llm, prompts) == expected
    assert llm.totals.prefix_cache_hits > 0


def test_tiny_kv_cache_preempts_and_resumes(family, prompts):
    path, expected = family
    # One request's worth of blocks at max_model_len 64 (4 blocks of 16 per
    # full-attention group, at most 3 per windowed one: a 16-token chunk and
    # the 5 tokens before it) for four requests growing from 2 blocks to 4
    # per group: they cannot all stay resident.
    config = AutoConfig.from_pretrained(path)
    groups = KVCacheGroups.plan(ModelSpec.from_hf_config(config).layer_windows, True)
    one_request = sum(blocks_held(64, 16, w, 16) for w in groups.windows)
    llm = LLM(
        str(path),
        enable_prefix_caching=False,
        max_model_len=64,
        max_num_batched_tokens=16,
        num_blocks_override=1 + one_request,
        exact=True,
    )
    assert llm.core.config.cache.group_windows == groups.windows
    assert _generate(llm, prompts) == expected
    assert llm.totals.num_preemptions > 0


def test_decode_stack_for_every_family_with_a_kernel_head_dim(family):
    path, _ = family
    llm = LLM(str(path), enable_prefix_caching=False, exact=True)
    if cpu_kernels.load() is None:
        pytest.skip("no compiled CPU kernels here")
    model = llm.core.worker.loaded.model
    runs_stack = model.spec.head_dim in cpu_kernels.HEAD_DIMS
    assert (model.decode_stack is not None) == runs_stack


def test_windowed_layers_with_drafts_and_async_scheduling(family, prompts):
    """Rejected drafts take computed tokens back and asynchronous steps run
    ahead of the scheduler: a windowed group must still hold what its
    layers read (the manager keeps the drafts' worth behind the window)."""
    path, expected = family
    windows = ModelSpec.from_hf_config(AutoConfig.from_pretrained(path)).layer_windows
    if all(w is None for w in windows):
        pytest.skip("no sliding-window layers")
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False
    )
    groups = KVCacheGroups.plan(windows, True)
    # A cache so small that freed blocks are soon someone else's.
    one_request = sum(blocks_held(64, 16, w, 16 + 3) for w in groups.windows)
    llm = LLM(
        str(path),
        max_model_len=64,
        max_num_batched_tokens=16,
        num_blocks_override=1 + one_request + 2,
        speculative=spec,
        async_scheduling=True,
        exact=True,
    )
    assert llm.core.config.cache.group_windows == groups.windows
    assert _generate(llm, prompts) == expected
    stats = llm.core.scheduler.spec_stats
    assert stats is not None and stats.num_draft_tokens > stats.num_accepted_tokens
