"""Shared fixtures: transformers' own model as the reference and eight chat
prompts (the default model's path and tokenizer are session fixtures of
tests/conftest.py)."""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from engine.llm import LLM

CHAT_SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one or two short "
    "sentences, name prices in euros, and never invent opening hours."
)
CHAT_QUESTIONS = [
    "Hi!",
    "What is bread made of?",
    "Give me three names for a sourdough starter.",
    "Explain, step by step and in detail, how to fold croissant dough so that the "
    "layers of butter stay separate, and what goes wrong when the kitchen is too warm.",
    "Count from one to ten.",
    "Is rye flour gluten free?",
    "Write a haiku about an oven at dawn, then explain the imagery you chose, the "
    "season it evokes, and why bakers start so early in the morning.",
    "What is 12 times 7?",
]


@pytest.fixture(scope="session")
def chat_prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Eight chat prompts of mixed length sharing one system prompt."""
    out = []
    for q in CHAT_QUESTIONS:
        messages = [{"role": "system", "content": CHAT_SYSTEM}, {"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text))
    return out


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path):
    """transformers' own implementation of the default model, as reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model


@pytest.fixture(scope="session")
def plain_llm() -> LLM:
    """One engine with the defaults (max_model_len 512) for every module
    that only compares outputs: building one takes seconds. Tests that read
    its counters or change its state build their own."""
    return LLM(max_model_len=512)


@pytest.fixture(scope="session")
def exact_llm() -> LLM:
    """As ``plain_llm`` on the exact path (``exact=True``: float
    activations, a float32 KV cache), for modules whose comparisons hold
    only there (engine/numerics.py)."""
    return LLM(max_model_len=512, exact=True)


@pytest.fixture(autouse=True, scope="session")
def _small_default_kv_cache() -> Iterator[None]:
    """Engines built without a KV-cache size get 512 MiB here, not the 2 GiB
    default: two test workers hold several engines each in 24 GiB, and
    zeroing 2 GiB costs every engine half a second. No test here holds more
    than a few thousand tokens at once."""
    from engine.worker import kv_cache

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_cache, "DEFAULT_CPU_KV_CACHE_BYTES", 512 * 1024**2)
        yield


@pytest.fixture(autouse=True, scope="module")
def _release_engines() -> Iterator[None]:
    """Each module's engines go with it, back to the OS: gigabytes of
    weights and KV cache per engine, which the servers of the integration
    tests later in the session need. EngineCore gc.freeze()s what is alive
    when it starts (so steps do not rescan it), which would keep a finished
    module's engines (they hold reference cycles); and glibc keeps freed
    heap memory mapped (5+ GB after these modules) unless trimmed."""
    yield
    gc.unfreeze()
    gc.collect()
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
