"""Assembles what benchmarks/gpu_check.py needs on a GPU machine without network.

    .venv/bin/python benchmarks/gpu_bundle.py              # -> build/gpu_bundle/
    python benchmarks/gpu_check.py --bundle build/gpu_bundle   # on the GPU machine

The folder (under ``build/``, which .gitignore already ignores: a device run
must name it in ``carry``) holds:

* ``tokenizer/``: the default model's tokenizer files (tokenizer.json,
  tokenizer_config.json, special_tokens_map.json, vocab.json, merges.txt,
  chat_template.jinja, whichever exist), with ``tokenizer_class`` written as
  ``PreTrainedTokenizerFast`` (transformers 5 saves ``TokenizersBackend``,
  which transformers 4 does not know; both load the former);
* cp312 manylinux x86_64 wheels: ``gguf`` (engine.models.gguf_weights
  imports it, so the engine does not import without it), ``xgrammar`` and
  what it imports that a torch + transformers machine may lack
  (``apache-tvm-ffi``, ``pydantic`` with ``pydantic-core``,
  ``annotated-types``, ``typing-inspection``), each at the version this
  checkout's .venv runs, fetched with ``pip download --only-binary=:all:
  --python-version 3.12 --platform manylinux_2_28_x86_64 --no-deps``;
* ``MANIFEST.txt``: every file and its size.

A wheel that would take the folder past ``--max-mib`` (50) is left out and
said so. Nothing here is needed on this machine; the GPU check installs the
wheels into a folder of its own (``pip install --no-deps --no-index
--target``) and appends it to ``sys.path``, so the GPU machine's own
packages win where both have one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "build" / "gpu_bundle"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
# Most important first: the engine does not import without gguf.
WHEELS = (
    "gguf",
    "xgrammar",
    "apache-tvm-ffi",
    "pydantic-core",
    "pydantic",
    "annotated-types",
    "typing-inspection",
)
# manylinux_2_28 first; pip takes only the tags named, so the older ones
# (pydantic-core publishes manylinux_2_17 wheels) are named too.
PIP_PLATFORM = (
    "--python-version",
    "3.12",
    *("--platform", "manylinux_2_28_x86_64"),
    *("--platform", "manylinux_2_17_x86_64"),
    *("--platform", "manylinux2014_x86_64"),
)


def copy_tokenizer(out: Path) -> list[Path]:
    from engine.models.loader import resolve_model

    source = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
            copied.append(out / name)
    config_path = out / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        if config.get("tokenizer_class") == "TokenizersBackend":
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            config_path.write_text(json.dumps(config, indent=2) + "\n")
    return copied


def pinned(name: str) -> str:
    """``name==version`` where this .venv has it, else ``name``."""
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def download_wheel(requirement: str, dest: Path) -> tuple[Path | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", *PIP_PLATFORM]
        cmd += ["--no-deps", "--dest", tmp, requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            return None, (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / wheels[0].name
        shutil.move(str(wheels[0]), target)
        return target, ""


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-mib", type=float, default=50.0)
    parser.add_argument("--no-wheels", action="store_true", help="the tokenizer only")
    args = parser.parse_args()
    out: Path = args.out
    limit = int(args.max_mib * 2**20)
    if out.exists():
        shutil.rmtree(out)
    for path in copy_tokenizer(out / "tokenizer"):
        print(f"tokenizer  {path.name:<40} {path.stat().st_size / 2**20:8.2f} MiB")
    if not args.no_wheels:
        for name in WHEELS:
            requirement = pinned(name)
            wheel, error = download_wheel(requirement, out / "wheels")
            if wheel is None:
                print(f"wheel      {requirement:<40} NOT FETCHED: {error}")
                continue
            size = wheel.stat().st_size
            if tree_bytes(out) > limit:
                wheel.unlink()
                print(
                    f"wheel      {wheel.name:<40} {size / 2**20:8.2f} MiB LEFT OUT: over the limit"
                )
                continue
            print(f"wheel      {wheel.name:<40} {size / 2**20:8.2f} MiB")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    manifest = [f"{p.stat().st_size:>10} {p.relative_to(out)}" for p in files]
    (out / "MANIFEST.txt").write_text("\n".join(manifest) + "\n")
    print(f"total {tree_bytes(out) / 2**20:.2f} MiB in {out}")
    try:
        ignored = (
            subprocess.run(
                ["git", "check-ignore", "-q", str(out)], cwd=ROOT, check=False
            ).returncode
            == 0
        )
    except FileNotFoundError:
        ignored = True
    if not ignored:
        print(f"note: {out} is not ignored by git")
    print(
        f"on the GPU machine: python benchmarks/gpu_check.py --bundle {out.relative_to(ROOT)}"
        if out.is_relative_to(ROOT)
        else f"python benchmarks/gpu_check.py --bundle {out}"
    )


if __name__ == "__main__":
    main()
