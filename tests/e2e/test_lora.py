"""LoRA adapters on the default model against transformers + peft.

On the exact path (``exact=True``), which peft's float32 reference is.
Four adapters made with peft, once a session (tests/lora_adapters.py; ranks
8 and 16, attention-only, MLP-only, all seven projections, rsLoRA scaling):
Tandem's greedy output under each equals peft's generate() token for token;
one batch mixing three adapters and base-model requests gives each request
its own reference; with max_loras = 2 (and a host cache of 2, so adapters
are read from disk again; with asynchronous scheduling) no step runs more
than two adapters and every request still gets its reference; and the prefix cache never serves one
adapter's KV to another.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import LoRAConfig
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.lora_adapters import MAX_TOKENS

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


# The adapters, prompts and reference are the session's (tests/conftest.py):
# tests/integration/test_lora.py serves the same ones.
@pytest.fixture(scope="module")
def adapters(lora_adapters: dict[str, Path]) -> dict[str, Path]:
    return lora_adapters


@pytest.fixture(scope="module")
def prompts(lora_prompts: list[list[int]]) -> list[list[int]]:
    return lora_prompts


@pytest.fixture(scope="module")
def reference(
    lora_reference: dict[str | None, list[list[int]]],
) -> dict[str | None, list[list[int]]]:
    return lora_reference


def _loaded(config: LoRAConfig, adapters: dict[str, Path], async_scheduling: bool = False) -> LLM:
    llm = LLM(
        max_model_len=256,
        kv_cache_memory=2**26,
        lora=config,
        async_scheduling=async_scheduling,
        exact=True,
    )
    for name, path in adapters.items():
        llm.load_lora(name, str(path))
    return llm


@pytest.fixture(scope="module")
def llm(adapters) -> Iterator[LLM]:
    yield _loaded(LoRAConfig(max_loras=4, max_lora_rank=16), adapters)


def _tokens(llm: LLM, prompts, lora) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, lora=lora, use_tqdm=False)]


def test_adapters_change_the_output(reference):
    """Otherwise the comparisons below could not tell an adapter was applied."""
    for name in ("qv8", "all16", "mlp8", "attn16"):
        assert reference[name] != reference[None], name


@pytest.mark.parametrize("name", ["qv8", "all16", "mlp8", "attn16"])
def test_each_adapter_equals_peft(llm, prompts, reference, name):
    assert _tokens(llm, prompts, name) == reference[name]


def test_one_batch_mixes_adapters_and_base_rows(llm, prompts, reference):
    names = [None, "qv8", "all16", "mlp8"] * len(prompts)
    batch = [prompts[i // 4] for i in range(len(names))]
    outs = _tokens(llm, batch, names)
    for i, (out, name) in enumerate(zip(outs, names, strict=True)):
        assert out == reference[name][i // 4], (i, name)


def test_max_loras_two_with_four_adapters(adapters, prompts, reference):
    # Asynchronous scheduling too: adapters move into device slots on the
    # runner thread while the engine thread schedules the next step.
    config = LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    llm = _loaded(config, adapters, async_scheduling=True)
    step_sets: list[set[int]] = []
    schedule = llm.core.scheduler.schedule

    def recording_schedule():
        out = schedule()
        ids = {r.lora_int_id for r in llm.core.scheduler.running if r.lora_int_id}
        ids &= {
            r.lora_int_id
            for r in llm.core.scheduler.requests.values()
            if r.request_id in out.num_scheduled_tokens
        }
        step_sets.append(ids)
        return out

    llm.core.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    names = [n for n in adapters for _ in prompts]
    batch = prompts * len(adapters)
    outs = _tokens(llm, batch, names)
    for i, (out, name) in enumerate(zip(outs, names, strict=True)):
        assert out == reference[name][i % len(prompts)], (i, name)
    assert max(len(s) for s in step_sets) == 2
    assert set().union(*step_sets) == {r.lora_int_id for r in llm.list_loras()}
    slots = llm.core.worker.runner.lora
    assert slots is not None and slots.stats.disk_reads > 0  # the host LRU evicted


def test_prefix_cache_is_per_adapter(llm, tokenizer):
    prompt = tokenizer.encode("A long shared instruction that fills blocks. " * 6)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    first = llm.generate([prompt], params, lora="qv8", use_tqdm=False)[0]
    other = llm.generate([prompt], params, lora="attn16", use_tqdm=False)[0]
    base = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, lora="qv8", use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0
    assert base.num_cached_tokens == 0
    assert again.num_cached_tokens >= len(prompt) - 16


def test_unknown_adapter_names_the_loaded_ones(llm, prompts):
    with pytest.raises(InvalidRequestError, match=r"lora: unknown LoRA adapter 'nope'.*qv8"):
        llm.generate(prompts[:1], GREEDY, lora="nope", use_tqdm=False)


def test_unload_then_reload_under_the_same_name(llm, adapters, prompts, reference):
    llm.unload_lora("mlp8")
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'mlp8'"):
        llm.generate(prompts[:1], GREEDY, lora="mlp8", use_tqdm=False)
    # Another adapter's files under the old name: its own outputs, not mlp8's.
    llm.load_lora("mlp8", str(adapters["qv8"]))
    try:
        assert _tokens(llm, prompts, "mlp8") == reference["qv8"]
    finally:
        llm.unload_lora("mlp8")
        llm.load_lora("mlp8", str(adapters["mlp8"]))
