"""Import smoke test: the generic top-level names must be Tandem's own, and
the scheduler, the KV cache and the router stay free of torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_top_level_packages_come_from_this_repository():
    import connectors
    import engine
    import kernels
    import service

    for module in (engine, service, connectors, kernels):
        assert module.__file__ is not None
        assert Path(module.__file__).resolve().is_relative_to(ROOT), module.__file__


def _assert_imports_none_of(modules: str, roots: tuple[str, ...]) -> None:
    """Importing `modules` (comma-separated) in a fresh interpreter loads
    no module under any of `roots`."""
    code = (
        f"import sys; import {modules};"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {roots!r}];"
        "print(bad[:5]); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scheduler_and_kv_cache_do_not_import_torch():
    _assert_imports_none_of("engine.sched.scheduler, engine.kv_cache", ("torch", "numpy", "vllm"))


def test_the_router_imports_neither_torch_nor_transformers():
    """It holds no model. With them a router took 3.8 s to listen and
    266 MB; without, 0.37 s and 45 MB (benchmarks/startup_bench.py)."""
    _assert_imports_none_of(
        "service.cli, service.router, service.pods, service.tls", ("torch", "transformers")
    )


def test_no_module_imports_vllm_or_sglang():
    offenders = []
    for path in ROOT.glob("**/*.py"):
        if ".venv" in path.parts or path.parent.name == "baselines":
            continue
        for line in path.read_text().splitlines():
            words = line.strip().split()
            if (
                len(words) >= 2
                and words[0] in ("import", "from")
                and (words[1].split(".")[0] in ("vllm", "sglang"))
            ):
                offenders.append(f"{path}: {line.strip()}")
    assert offenders == []
