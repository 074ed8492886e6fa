"""engine/models/gguf_table.py against the gguf package's own reader, on a
small GGUF written by the gguf package (metadata of every kind, including
arrays of strings, and tensors in F32, F16, Q4_1 and Q8_0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from engine.models.gguf_table import read_gguf_table


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("some.flag", True)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc", "ünï"])
    writer.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5, 3.5])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("half.weight", rng.standard_normal((4, 64)).astype(np.float16))
    blocks = {"q41.weight": GGMLQuantizationType.Q4_1, "q8.weight": GGMLQuantizationType.Q8_0}
    for name, qtype in blocks.items():
        values = rng.standard_normal((8, 64)).astype(np.float32)
        writer.add_tensor(name, quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tensors_equal_the_gguf_readers(gguf_file: Path) -> None:
    table = read_gguf_table(gguf_file)
    reference = GGUFReader(gguf_file)
    assert table.architecture == "llama"
    assert [t.name for t in table.tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(table.tensors, reference.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape.tolist())), ours.name
        assert ours.data.dtype == np.uint8
        assert ours.data.tobytes() == np.asarray(theirs.data).tobytes(), ours.name


def test_not_a_gguf_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_table(path)


def test_a_truncated_file_is_refused(gguf_file: Path, tmp_path: Path) -> None:
    whole = gguf_file.read_bytes()
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(whole[:20])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_table(header_cut)
    data_cut = tmp_path / "data.gguf"
    data_cut.write_bytes(whole[:-100])
    with pytest.raises(ValueError, match="runs past the end"):
        read_gguf_table(data_cut)


def test_scalar_metadata_is_kept_and_arrays_skipped(gguf_file: Path) -> None:
    table = read_gguf_table(gguf_file)
    assert table.architecture == "llama"
    assert table.scalars["llama.block_count"] == 2
    assert table.scalars["llama.rope.freq_base"] == 10000.0
    assert table.scalars["some.flag"] is True
    assert table.scalars["general.name"] == "tiny"
    assert not {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "nested"} & set(table.scalars)
    assert table.tensor("q8.weight") is not None and table.tensor("absent") is None
