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
    results: dict[str | None, list[list[int]]] = {}
    # One left-padded batch per adapter (generate() one prompt at a time
    # costs ~4x more, and this runs in every test session).
    width = max(len(ids) for ids in prompts)
    eos = model.config.eos_token_id
    input_ids = torch.tensor([[eos] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "max_new_tokens": max_tokens,
        "do_sample": False,
        "pad_token_id": eos,
    }
    generate: Any = model.generate
    with torch.inference_mode():
        for adapter in [None, *names]:
            if adapter is None:
                with model.disable_adapter():
                    gen = generate(**kwargs)
            else:
                model.set_adapter(adapter)
                gen = generate(**kwargs)
            results[adapter] = gen[:, width:].tolist()
    return results
