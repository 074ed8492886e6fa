"""A long public-domain English text every machine with the test set-up has:
Newton's *Opticks* as shipped by the apache-tvm-ffi package (a dependency of
xgrammar), for perplexities and long prompts."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def opticks_text() -> str:
    """The book's text from its first advertisement on (past the
    transcribers' header)."""
    spec = importlib.util.find_spec("tvm_ffi")
    assert spec is not None and spec.origin is not None, "apache-tvm-ffi (xgrammar's) is missing"
    path = Path(spec.origin).parent / "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
    text = path.read_text(encoding="utf-8")
    return text[text.index("Advertisement I") :]
