"""The model's tokenizer files as one zip archive, for GetTokenizer: the
gateway (smg) builds its tokenizer and chat template from it, so it needs
no copy of the model's files.

Built once per process on a worker thread (reading and deflating the files
takes a few hundred milliseconds the event loop must not spend), then
served from memory: the model directory does not change while it serves.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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


def build_archive(model_dir: Path) -> Archive:
    """Raises FileNotFoundError when the directory has no tokenizer file."""
    buf = io.BytesIO()
    found = 0
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            path = model_dir / name
            if path.is_file():
                zf.write(path, name)
                found += 1
    if not found:
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    data = buf.getvalue()
    return Archive(data, hashlib.sha256(data).hexdigest())


class TokenizerBundle:
    """One model directory's archive, built on first use."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._archive: Archive | None = None
        self._lock = asyncio.Lock()

    async def archive(self) -> Archive:
        async with self._lock:
            if self._archive is None:
                self._archive = await asyncio.to_thread(build_archive, self.model_dir)
            return self._archive
