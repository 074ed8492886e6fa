"""Shared fixtures: transformers' own model as the reference (the default
model's path and tokenizer are session fixtures of tests/conftest.py)."""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path):
    """transformers' own implementation of the default model, as reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model


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
