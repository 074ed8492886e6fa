"""PEFT adapters for the default model, made in tests with peft itself.

Random, non-zero A and B (peft's own init leaves B zero, which would hide a
wrong B); B is kept small enough that the adapted model still writes text,
so greedy choices are not near-ties that float noise could flip.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...]
    alpha: int
    use_rslora: bool = False


ADAPTERS = (
    AdapterSpec("qv8", 8, ("q_proj", "v_proj"), 16),
    AdapterSpec(
        "all16",
        16,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        32,
    ),
    AdapterSpec("mlp8", 8, ("gate_proj", "up_proj", "down_proj"), 8, use_rslora=True),
    AdapterSpec("attn16", 16, ("q_proj", "k_proj", "v_proj", "o_proj"), 16),
)

# The prompts and length of the session's peft reference (lora_reference in
# tests/conftest.py), for tests/e2e/test_lora.py and
# tests/integration/test_lora.py. Every adapter changes the greedy answer to
# TEXTS[1] (the one the integration tests send) within MAX_TOKENS, and no
# answer has an EOS there (peft's reference stops at EOS; the tests'
# requests ignore it).
TEXTS = ("The capital of France is", "Write a haiku about the sea.", "def fib(n):")
MAX_TOKENS = 10


def load_base(model_path: Path) -> torch.nn.Module:
    """A fresh transformers model (peft wraps it in place: never the shared one)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def make_adapters(
    model_path: Path, out: Path, specs: tuple[AdapterSpec, ...] = ADAPTERS
) -> dict[str, Path]:
    """Saves one PEFT adapter directory per spec under ``out``."""
    from peft import LoraConfig, get_peft_model

    paths = {}
    base = load_base(model_path)  # wrapped and unwrapped again for each adapter
    for seed, spec in enumerate(specs):
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.targets),
            use_rslora=spec.use_rslora,
            init_lora_weights=False,
            lora_dropout=0.0,
        )
        model = get_peft_model(base, config)
        generator = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name:
                    scale = param.shape[1] ** 0.5
                    param.copy_(torch.randn(param.shape, generator=generator) / scale)
                elif "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.04)
        path = out / spec.name
        model.save_pretrained(str(path))
        paths[spec.name] = path
        base = model.unload()
    return paths


def peft_generate(
    model_path: Path, adapters: dict[str, Path], prompts: list[list[int]], max_tokens: int
) -> dict[str | None, list[list[int]]]:
    """Greedy outputs of transformers + peft per adapter (None: the base model)."""
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(
        load_base(model_path), adapters[names[0]], adapter_name=names[0]
    )
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    # One left-padded batch of every (adapter, prompt) pair, each row under
    # its own adapter (peft's mixed-adapter batches, "__base__": none):
    # max_tokens steps in all, not one generate() per adapter (5x the steps;
    # one prompt at a time costs more still, and this runs in every test
    # session). Token for token the same outputs as a batch per adapter.
    rows = [(adapter, ids) for adapter in [None, *names] for ids in prompts]
    width = max(len(ids) for ids in prompts)
    eos = model.config.eos_token_id
    generate: Any = model.generate
    with torch.inference_mode():
        gen = generate(
            input_ids=torch.tensor([[eos] * (width - len(ids)) + ids for _, ids in rows]),
            attention_mask=torch.tensor(
                [[0] * (width - len(ids)) + [1] * len(ids) for _, ids in rows]
            ),
            adapter_names=["__base__" if a is None else a for a, _ in rows],
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=eos,
        )
    results: dict[str | None, list[list[int]]] = {}
    for (adapter, _), out in zip(rows, gen[:, width:].tolist(), strict=True):
        results.setdefault(adapter, []).append(out)
    return results
