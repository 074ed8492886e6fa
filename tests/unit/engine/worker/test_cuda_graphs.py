"""CUDA graphs' bookkeeping without CUDA (engine/worker/cuda_graphs.py).

The graph path is the static-buffer step: fill persistent buffers, pad to a
captured size, replay. With ``EagerCapture`` a "replay" calls the captured
forward again over those buffers, so everything but the CUDA graph itself
runs here: the chosen sizes, the padding rows, the per-group block tables,
the fallbacks. Each engine test runs the same requests on a twin engine
without graphs and wants the same tokens, and the KV caches equal outside
the null block (where padding rows write).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerBase

from engine.config import LoRAConfig, ModelConfig, SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import EagerCapture, capture_sizes, padded_size
from engine.worker.model_runner import ModelRunner
from tests.lora_adapters import AdapterSpec, make_adapters
from tests.unit.engine.models.families import (
    TINY_SHAPE,
    TINY_VOCAB,
    architecture_name,
    family_configs,
    randomize_weights,
)

SIZES = (1, 2, 4, 6)


# --- sizes and fallbacks ------------------------------------------------------------


def test_default_sizes_follow_vllms_list_up_to_the_rows_a_step_can_have() -> None:
    assert capture_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes(2048)[-1] == 512  # capped
    assert capture_sizes(12) == (1, 2, 4, 8, 12)  # the cap itself is a size
    assert capture_sizes(3) == (1, 2, 3)


def test_one_given_size_caps_the_list_and_several_are_the_list() -> None:
    assert capture_sizes(256, (16,)) == (1, 2, 4, 8, 16)
    assert capture_sizes(256, (24, 3, 3, 5)) == (3, 5, 24)
    assert capture_sizes(4, (1, 8, 32)) == (1, 8)  # 32 never runs with 4 rows


def test_a_step_pads_to_the_smallest_size_holding_it_or_runs_eagerly() -> None:
    sizes = (1, 2, 4, 8, 16)
    assert [padded_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert padded_size(sizes, 17) is None


def test_cuda_graph_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        ModelConfig(cuda_graph_sizes=(8, 0))
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        ModelConfig(cuda_graph_sizes=())


# --- the engine with "replayed" graphs against the engine without -----------------


@pytest.fixture(scope="module")
def tiny_models(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase
) -> dict[str, Path]:
    """A tiny Llama (one KV cache group) and a tiny Gemma 3 whose windowed
    layers make three groups, each saved with the default tokenizer."""
    configs = {
        "llama": LlamaConfig(**TINY_SHAPE),
        "gemma3": family_configs(TINY_SHAPE)["gemma3-sliding-window"],
    }
    paths = {}
    for name, config in configs.items():
        config.architectures = [architecture_name(config)]
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        randomize_weights(hf)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _runner(llm: LLM) -> ModelRunner:
    return llm.core.worker.runner


def _pair(path: Path, **options: Any) -> tuple[LLM, LLM]:
    """(engine with graphs of SIZES, twin without), same options. The
    reference attention reads the metadata's tensors on every call, as the
    Triton kernels do (the torch backend caches a plan per metadata object:
    graphs are off with it)."""
    options = {
        "exact": True,
        "attention_backend": "reference",
        "kv_cache_memory": 1 << 22,  # not the CPU's 2 GiB: the caches are compared
        **options,
    }
    graphs = LLM(str(path), **options)
    _runner(graphs).attach_graphs(EagerCapture(), SIZES)
    eager = LLM(str(path), **options)
    return graphs, eager


def _assert_same_caches_outside_the_null_block(a: LLM, b: LLM) -> None:
    for cache_a, cache_b in zip(_runner(a).kv_caches, _runner(b).kv_caches, strict=True):
        torch.testing.assert_close(cache_a[:, 1:], cache_b[:, 1:], rtol=0, atol=1e-5)


def _greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_replayed_steps_equal_eager_steps_at_every_size(
    tiny_models: dict[str, Path], model: str
) -> None:
    """Six requests finishing one after another: decode steps of 6 rows
    down to 1, every size of the list replayed, with padding at 3 and 5."""
    graphs, eager = _pair(tiny_models[model], enable_prefix_caching=False)
    prompts = _prompts(6)
    params = _greedy([2 + i for i in range(6)])
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == want
    replayed = _runner(graphs).graphs
    assert replayed is not None
    assert set(replayed.replayed) == set(SIZES)
    _assert_same_caches_outside_the_null_block(graphs, eager)


def test_more_rows_than_the_largest_graph_run_eagerly(tiny_models: dict[str, Path]) -> None:
    graphs, eager = _pair(tiny_models["llama"], enable_prefix_caching=False)
    prompts = _prompts(7, seed=1)
    params = _greedy([4] * 7)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == want
    replayed = _runner(graphs).graphs
    assert replayed is not None
    assert sum(replayed.replayed.values()) == 0  # 7 rows every decode step: none fits


def test_draft_verification_rows_replay_too(tiny_models: dict[str, Path]) -> None:
    """N-gram drafts: a step verifying k drafts is k + 1 token rows a
    request, run on the same graphs (prompts repeat so drafts are found;
    drafts on every step, not only where this machine's timings say they pay)."""
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=2, prompt_lookup_max=2, adaptive=False
    )
    graphs, eager = _pair(tiny_models["llama"], speculative=spec)
    prompts = [p * 3 for p in _prompts(2, seed=2)]
    params = _greedy([24, 24])
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == want
    replayed = _runner(graphs).graphs
    assert replayed is not None
    assert any(size > 2 for size in replayed.replayed), "no step verified drafts on a graph"


def test_steps_with_lora_rows_run_eagerly(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    adapters = make_adapters(
        tiny_models["llama"], tmp_path, (AdapterSpec("qv4", 4, ("q_proj", "v_proj"), 8),)
    )
    graphs, eager = _pair(tiny_models["llama"], lora=LoRAConfig(max_lora_rank=8))
    for llm in (graphs, eager):
        llm.load_lora("qv4", str(adapters["qv4"]))
    prompts = _prompts(3, seed=3)
    params = _greedy([8, 8, 8])
    want = [o.token_ids for o in eager.generate(prompts, params, lora="qv4")]
    replayed = _runner(graphs).graphs
    assert replayed is not None
    got = [o.token_ids for o in graphs.generate(prompts, params, lora="qv4")]
    assert got == want
    assert sum(replayed.replayed.values()) == 0
    base = [o.token_ids for o in graphs.generate(prompts, params)]
    assert base == [o.token_ids for o in eager.generate(prompts, params)]
    assert sum(replayed.replayed.values()) > 0  # base-only steps do replay
