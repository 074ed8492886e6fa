"""Reading PEFT adapter directories: the fused slot layout, and errors that
name the file and key. Synthetic adapters on a tiny config (no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from engine.config import LoRAConfig
from engine.errors import InvalidRequestError
from engine.lora.adapter import LoRAAdapterError, read_adapter
from engine.lora.registry import LoRARegistry
from engine.models.spec import ModelSpec

SPEC = ModelSpec.from_hf_config(
    LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )
)  # head_dim 4: q 16, k and v 8 each
PREFIX = "base_model.model.model.layers"


def _write(path: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none", **config}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _pair(layer: int, module: str, rank: int, in_f: int, out_f: int) -> dict[str, torch.Tensor]:
    where = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
    key = f"{PREFIX}.{layer}.{where}.{module}"
    gen = torch.Generator().manual_seed(layer * 10 + len(module))
    return {
        f"{key}.lora_A.weight": torch.randn(rank, in_f, generator=gen),
        f"{key}.lora_B.weight": torch.randn(out_f, rank, generator=gen),
    }


def test_fused_layout_equals_the_unfused_products(tmp_path):
    tensors = {**_pair(1, "k_proj", 2, 16, 8), **_pair(1, "up_proj", 2, 16, 24)}
    adapter = read_adapter(_write(tmp_path / "a", tensors), SPEC, max_rank=4)
    assert adapter.rank == 2 and adapter.target_modules == ("k_proj", "up_proj")
    assert adapter.layers[0] == {}
    x = torch.randn(3, 16)
    a, b = adapter.layers[1]["qkv_proj"]
    assert a.shape == (12, 16) and b.shape == (32, 12)  # 3 shards x rank 4; q+k+v rows
    key = f"{PREFIX}.1.self_attn.k_proj"
    expected_k = x @ tensors[f"{key}.lora_A.weight"].T @ tensors[f"{key}.lora_B.weight"].T * 2
    delta = x @ a.T @ b.T
    torch.testing.assert_close(delta[:, 16:24], expected_k)
    assert delta[:, :16].abs().max() == 0 and delta[:, 24:].abs().max() == 0
    a, b = adapter.layers[1]["gate_up_proj"]
    key = f"{PREFIX}.1.mlp.up_proj"
    expected_up = x @ tensors[f"{key}.lora_A.weight"].T @ tensors[f"{key}.lora_B.weight"].T * 2
    torch.testing.assert_close((x @ a.T @ b.T)[:, 24:], expected_up)


def test_rslora_scales_by_the_square_root(tmp_path):
    tensors = _pair(0, "o_proj", 4, 16, 16)
    plain = read_adapter(_write(tmp_path / "p", tensors, r=4), SPEC, max_rank=4)
    rs = read_adapter(_write(tmp_path / "r", tensors, r=4, use_rslora=True), SPEC, max_rank=4)
    ratio = rs.layers[0]["o_proj"][1].norm() / plain.layers[0]["o_proj"][1].norm()
    assert ratio.item() == pytest.approx(2.0)  # (4 / sqrt 4) / (4 / 4)


@pytest.mark.parametrize(
    ("tensors", "config", "message"),
    [
        (_pair(0, "q_proj", 8, 16, 16), {}, r"q_proj.lora_A.weight has rank 8.*max_lora_rank=4"),
        (_pair(0, "q_proj", 2, 12, 16), {}, r"q_proj.lora_A.weight has shape \(2, 12\)"),
        (_pair(0, "q_proj", 2, 16, 8), {}, r"q_proj.lora_B.weight has shape \(8, 2\)"),
        (_pair(5, "q_proj", 2, 16, 16), {}, r"layers.5.*the model has 2 layers"),
        (
            {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 16)},
            {},
            r"key 'base_model.model.lm_head.lora_A.weight' is not a LoRA weight",
        ),
        (
            {f"{PREFIX}.0.mlp.down_proj.lora_A.weight": torch.zeros(2, 24)},
            {},
            r"down_proj.lora_A.weight has no matching lora_B",
        ),
        (_pair(0, "q_proj", 2, 16, 16), {"bias": "all"}, r"adapter_config.json: bias='all'"),
        (_pair(0, "q_proj", 2, 16, 16), {"use_dora": True}, "use_dora=True is not supported"),
        (_pair(0, "q_proj", 2, 16, 16), {"lora_alpha": 0}, "lora_alpha=0"),
    ],
)
def test_bad_adapters_name_file_and_key(tmp_path, tensors, config, message):
    path = _write(tmp_path / "bad", tensors, **config)
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(path, SPEC, max_rank=4)


def test_missing_files(tmp_path):
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        read_adapter(tmp_path / "nowhere", SPEC, max_rank=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAAdapterError, match=r"empty/adapter_config.json: missing"):
        read_adapter(tmp_path / "empty", SPEC, max_rank=4)
    path = _write(tmp_path / "j", _pair(0, "q_proj", 2, 16, 16))
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match=r"adapter_config\.json: not readable JSON"):
        read_adapter(path, SPEC, max_rank=4)


def test_registry_names_adapters_and_refuses_unknown_ones(tmp_path):
    registry = LoRARegistry(LoRAConfig(max_loras=2, max_lora_rank=4), SPEC)
    path = _write(tmp_path / "a", _pair(0, "q_proj", 2, 16, 16))
    request, _ = registry.read("tenant-a", str(path))
    registry.add(request)
    assert registry.resolve("tenant-a") is request and registry.resolve("") is None
    with pytest.raises(InvalidRequestError, match=r"already loaded"):
        registry.check_new_name("tenant-a")
    with pytest.raises(InvalidRequestError, match=r"lora: unknown LoRA adapter 'b'.*'tenant-a'"):
        registry.resolve("b")
    again, _ = registry.read("other", str(path))
    assert again.cache_key == request.cache_key  # same files, same KV identity
    assert again.lora_int_id != request.lora_int_id
    registry.remove("tenant-a")
    assert registry.loaded() == []
    off = LoRARegistry(None, SPEC)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        off.resolve("tenant-a")
