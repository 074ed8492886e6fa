"""The model's tokenizer files as one zip archive, for GetTokenizer: the
gateway (smg) builds its tokenizer and chat template from it, so it needs
no copy of the model's files.

The chat template in it is the one this server renders with (the
tokenizer's: the checkpoint's own, or ``--chat-template``'s), written as
``chat_template.jinja``: smg takes a template file over
tokenizer_config.json's entry, as transformers does, so the gateway and
Tandem's own chat input render alike. The directory's own template files
are left out then (smg reads chat_template.json before .jinja).

A gateway on the pod's host loads the tokenizer from the path GetModelInfo
reports, not from this archive: with ``--chat-template`` that path is the
archive unpacked into Tandem's cache (``TokenizerBundle.directory``), so
both ways give the gateway the server's template.

Built once per process on a worker thread (reading and deflating the files
takes a few hundred milliseconds the event loop must not spend), then
served from memory: the model directory does not change while it serves.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.models.loader import cache_dir

logger = logging.getLogger(__name__)

# What a tokenizer and chat template are built from (the names the
# transformers and tokenizers libraries read), plus the model's config for
# its special token ids.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "added_tokens.json",
)

# The template's file in the archive, and the directory's files it replaces.
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_FILES = ("chat_template.json", TEMPLATE_FILE)

# The gateway reassembles chunks of at most this size (smg's own limit).
CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class Archive:
    data: bytes
    sha256: str  # hex digest of ``data``

    def chunks(self) -> Iterator[tuple[bytes, str]]:
        """``(bytes, sha256)`` pieces in order; only the last carries the
        digest (the gateway checks the whole against it)."""
        for start in range(0, len(self.data), CHUNK_BYTES):
            end = start + CHUNK_BYTES
            yield self.data[start:end], self.sha256 if end >= len(self.data) else ""


def build_archive(model_dir: Path, chat_template: str | None = None) -> Archive:
    """The directory's tokenizer files, with ``chat_template`` (when given)
    as the archive's only template file. Raises FileNotFoundError when the
    directory has no tokenizer file."""
    buf = io.BytesIO()
    found = 0
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            path = model_dir / name
            if path.is_file() and not (chat_template is not None and name in TEMPLATE_FILES):
                _add(zf, name, path.read_bytes())
                found += 1
        if not found:
            raise FileNotFoundError(f"no tokenizer files in {model_dir}")
        if chat_template is not None:
            _add(zf, TEMPLATE_FILE, chat_template.encode())
    data = buf.getvalue()
    return Archive(data, hashlib.sha256(data).hexdigest())


def _add(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    """One entry with a fixed timestamp: the same files make the same
    archive (and digest) whenever and wherever it is built."""
    zf.writestr(zipfile.ZipInfo(name, date_time=_EPOCH), data, zipfile.ZIP_DEFLATED)


# zip's earliest date: entries carry no build time.
_EPOCH = (1980, 1, 1, 0, 0, 0)


def unpack(archive: Archive, root: Path) -> Path:
    """The archive's files in ``root/<digest>``: written once (into a
    temporary directory, then renamed, so a reader never sees half of
    them), shared by every server with the same files. Raises OSError when
    ``root`` is not writable."""
    target = root / archive.sha256[:24]
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".unpacking-"))
    try:
        with zipfile.ZipFile(io.BytesIO(archive.data)) as zf:
            zf.extractall(staging)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # not "another server unpacked them first"
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after a rename
    return target


class TokenizerBundle:
    """One model directory's archive with the server's chat template
    (None: none, or the directory's own named templates), built on first
    use."""

    def __init__(self, model_dir: Path, chat_template: str | None) -> None:
        self.model_dir = model_dir
        self.chat_template = chat_template
        self._archive: Archive | None = None
        # None: not tried yet; False: no writable place.
        self._directory: Path | Literal[False] | None = None
        self._lock = asyncio.Lock()

    async def archive(self) -> Archive:
        async with self._lock:
            if self._archive is None:
                self._archive = await asyncio.to_thread(
                    build_archive, self.model_dir, self.chat_template
                )
            return self._archive

    async def directory(self) -> Path | None:
        """The archive's files as a directory (``unpack``): under the
        cache, else (a read-only cache, as a pod's model volume) under the
        temporary directory; None where neither is writable."""
        archive = await self.archive()
        async with self._lock:
            if self._directory is None:
                self._directory = await asyncio.to_thread(_unpack_somewhere, archive)
            return self._directory or None


def _unpack_somewhere(archive: Archive) -> Path | Literal[False]:
    roots = (cache_dir() / "tokenizers", Path(tempfile.gettempdir()) / "tandem-tokenizers")
    for root in roots:
        try:
            return unpack(archive, root)
        except OSError as e:
            logger.warning("cannot unpack the tokenizer archive under %s: %s", root, e)
    return False
