"""Running Triton tests in a child interpreter (shared by the Triton test
modules): TRITON_INTERPRET must be set before triton is first imported, and
another test may already have imported it in this process; compiling for a
GPU target, on the other hand, needs it unset."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def start_child(module: str, function: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """Runs ``module.function()`` in a fresh interpreter, which prints its
    JSON-encoded result (read it with ``child_result``)."""
    code = f"import json\nfrom {module} import {function}\nprint(json.dumps({function}()))\n"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def child_result(proc: subprocess.Popen[str]) -> Any:
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


def ptxas_available() -> bool:
    """Whether the triton wheel bundles ptxas (what compiling for sm_90 needs)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()
