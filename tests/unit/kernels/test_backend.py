"""select_backend: explicit name > environment > device default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import AttentionBackend, reference, select_backend, torch_attention
from kernels.backend import ENV_VAR

# Seconds each (the real model, the Triton interpreter, child processes or
# Helm renders): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_cpu_default_is_torch() -> None:
    backend = select_backend(CPU)
    assert isinstance(backend, AttentionBackend)
    assert backend.name == "torch"
    assert backend.paged_attention is torch_attention.paged_attention
    assert backend.reshape_and_cache is torch_attention.reshape_and_cache


def test_cuda_default_is_triton() -> None:
    # Choosing needs no GPU: only the name is checked, triton is not launched.
    assert select_backend(torch.device("cuda")).name == "triton"


def test_triton_interpreter_makes_triton_the_cpu_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend(CPU).name == "triton"


def test_env_var_overrides_device_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "reference")
    backend = select_backend(CPU)
    assert backend.name == "reference"
    assert backend.paged_attention is reference.paged_attention


def test_explicit_name_overrides_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "reference")
    assert select_backend(CPU, "torch").name == "torch"


@pytest.mark.parametrize("via_env", [False, True])
def test_unknown_name_lists_known_ones(monkeypatch: pytest.MonkeyPatch, via_env: bool) -> None:
    if via_env:
        monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ValueError, match=r"'flash'.*torch, triton, reference"):
        select_backend(CPU, None if via_env else "flash")


def test_torch_backend_does_not_import_triton() -> None:
    code = (
        "import sys, torch; from kernels import select_backend;"
        "select_backend(torch.device('cpu'), 'torch');"
        "sys.exit(1 if 'triton' in sys.modules else 0)"
    )
    env_free = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env_free
    )
    assert proc.returncode == 0, proc.stderr
