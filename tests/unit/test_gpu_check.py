"""benchmarks/gpu_check.py's CPU smoke run: every section runs on a tiny
random model and the correctness checks pass (the GPU run is the same
script on a CUDA machine; see the script's docstring)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A child process that builds several engines (~15-40 s on the 2-core
# machine): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_run_passes_every_section():
    cmd = ["benchmarks/gpu_check.py", "--device", "cpu", "--shape", "tiny", "--quick"]
    proc = subprocess.run(
        [sys.executable, *cmd],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    # The nine numbered section headers, in order, each with its closing line.
    headers = [line for line in out.splitlines() if line.startswith("== ") and line[3].isdigit()]
    assert [h[3] for h in headers] == list("123456789"), headers
    assert out.count("\n-- ") == 9
    assert "PASS  greedy identity with transformers (float32)" in out
    assert "FAIL" not in out
    assert "total wall time" in out
