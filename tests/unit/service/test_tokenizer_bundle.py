"""The tokenizer archive the gateway builds its tokenizer from carries the
template this server renders with: ``--chat-template``'s, as the only
template file, which transformers (and smg: tests/integration/test_gateway.py)
take over tokenizer_config.json's."""

from __future__ import annotations

import asyncio
import io
import os
import tempfile
import zipfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from service.tokenizer_bundle import TokenizerBundle, build_archive, unpack

PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
HELLO = [{"role": "user", "content": "Hello"}]


def _unpack(data: bytes, into: Path) -> list[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        zf.extractall(into)
        return zf.namelist()


def test_the_servers_template_is_the_archives_only_template(
    default_model_path: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (model / name).write_bytes((default_model_path / name).read_bytes())
    (model / "chat_template.json").write_text('{"chat_template": "{{ 1 }}"}')
    names = _unpack(build_archive(model, PLAIN).data, tmp_path / "with")
    assert "chat_template.json" not in names
    assert (tmp_path / "with" / "chat_template.jinja").read_text() == PLAIN
    rebuilt = AutoTokenizer.from_pretrained(tmp_path / "with")
    text = rebuilt.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    assert text == "user: Hello\nassistant:"
    # Without one, the directory's files go as they are.
    names = _unpack(build_archive(model).data, tmp_path / "without")
    assert "chat_template.json" in names and "chat_template.jinja" not in names


def test_the_archive_unpacks_once_into_a_directory_named_by_its_digest(
    default_model_path: Path, tmp_path: Path
) -> None:
    """GetModelInfo's tokenizer path under --chat-template: a gateway on the
    pod's host loads the same files as the archive's."""
    archive = build_archive(default_model_path, PLAIN)
    first = unpack(archive, tmp_path)
    assert first.name == archive.sha256[:24]
    assert (first / "chat_template.jinja").read_text() == PLAIN
    assert unpack(archive, tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging left


def test_the_same_files_make_the_same_archive(default_model_path: Path, tmp_path: Path) -> None:
    """Entries carry no file times: a conversion redone, or a restart, gives
    the gateway the same digest and `unpack` the same directory."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((default_model_path / name).read_bytes())
    first = build_archive(model, PLAIN).sha256
    os.utime(model / "tokenizer.json", (1e9, 1e9))
    assert build_archive(model, PLAIN).sha256 == first


def test_a_read_only_cache_unpacks_under_the_temporary_directory(
    default_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod's cache on its read-only model volume: GetModelInfo's path is
    then under the temporary directory, never an error."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker / "cache"))  # cannot be made
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(OSError):
        unpack(build_archive(default_model_path, PLAIN), blocker / "cache")
    bundle = TokenizerBundle(default_model_path, PLAIN)
    where = asyncio.run(bundle.directory())
    assert where is not None and where.parent == tmp_path / "tmp" / "tandem-tokenizers"
    assert (where / "chat_template.jinja").read_text() == PLAIN
