"""The CPU baselines' shared workload: prompts cut out of real English text.

Standard library only, so that the llama.cpp runner (in /work/llamacppenv),
the vLLM CPU runner (in /work/vllmcpuenv) and Tandem's own side of a
benchmark can all import it (the runners put this folder on ``sys.path``).

The text is the docstrings of a fixed list of standard-library modules and of
their public members, in a fixed order, so it is the same wherever the same
Python (3.11 here) runs. Each engine tokenizes that text with its own
tokenizer (the GGUF's vocabulary or the Hugging Face one: the same BPE for
SmolLM2), and :func:`cut_prompts` then cuts windows out of the token ids: one
window per request, of a length drawn with a seeded ``random.Random`` between
``lo`` and ``hi``, at a drawn offset. Runners also print :func:`digest` of the
prompts, so a benchmark can check whether engines were given the same ids.

They are not quite: llama.cpp's tokenizer for the GGUF and the
``tokenizer.json`` of Tandem's converted directory split some runs of spaces
differently (50,103 against 50,145 tokens for this text), so the windows'
texts drift apart a little while their lengths stay the same. For identical
ids, give every runner the same ``--prompts-file`` (a JSON list of token-id
lists, e.g. made with Tandem's tokenizer and :func:`cut_prompts`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
from pathlib import Path

# Modules whose docstrings make up the text (prose, not code).
TEXT_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
)

DEFAULT_N = 64
DEFAULT_LO = 16
DEFAULT_HI = 256
DEFAULT_NEW_TOKENS = 128
DEFAULT_SEED = 0
SINGLE_PROMPT_LEN = 64


def prompt_text() -> str:
    """About 200k characters (some 45k tokens) of English prose, deterministic."""
    parts: list[str] = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        doc = inspect.getdoc(module)
        if doc:
            parts.append(doc)
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            if attr.startswith("_"):
                continue
            member = getattr(module, attr, None)
            if not (inspect.isclass(member) or inspect.isfunction(member)):
                continue
            doc = inspect.getdoc(member)
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(parts)


def cut_prompts(
    token_ids: list[int],
    n: int = DEFAULT_N,
    lo: int = DEFAULT_LO,
    hi: int = DEFAULT_HI,
    seed: int = DEFAULT_SEED,
) -> list[list[int]]:
    """N windows of ``token_ids``, lengths uniform in [lo, hi], seeded.

    The lengths depend only on (n, lo, hi, seed), not on ``token_ids``, so
    engines whose tokenizers differ a little still get prompts of the same
    lengths (offsets are drawn as fractions of the text, for the same reason).
    """
    if len(token_ids) < 2 * hi:
        raise ValueError(f"text too short: {len(token_ids)} tokens for windows of up to {hi}")
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = int(rng.random() * (len(token_ids) - length))
        prompts.append(token_ids[start : start + length])
    return prompts


def load_prompts(path: Path) -> list[list[int]]:
    """Prompts given as a JSON list of token-id lists (to override the text)."""
    data = json.loads(path.read_text())
    if not isinstance(data, list) or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in data
    ):
        raise ValueError(f"{path}: expected a JSON list of non-empty token-id lists")
    return data


def digest(prompts: list[list[int]]) -> str:
    """Short hash of the prompts' token ids, to compare runners' workloads."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
