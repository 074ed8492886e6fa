"""Shared fixtures: the default model, converted once, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.loader import load_tokenizer, resolve_model


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_path: Path):
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path):
    """transformers' own implementation of the default model, as reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model
