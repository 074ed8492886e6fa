"""Running Triton tests in a child interpreter (shared by the Triton test
modules): TRITON_INTERPRET must be set before triton is first imported, and
another test may already have imported it in this process; compiling for a
GPU target, on the other hand, needs it unset."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
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


def _a_stride(arg: str) -> bool:
    return arg.startswith("stride_")


def compile_sm90(
    kernel: Any,
    ptr_types: dict[str, str],
    constexprs: dict[str, Any],
    *,
    floats: tuple[str, ...] = (),
    divisible: Callable[[str], bool] = _a_stride,
    num_warps: int | None = None,
) -> Any:
    """Compiles ``kernel`` for sm_90 (an H100) with no GPU present; call it in
    a child interpreter without TRITON_INTERPRET. The signature follows the
    argument names: constexprs, pointers typed by ``ptr_types`` (``"*"`` for
    the rest), ``floats`` as fp32, the others i32. Pointers and the
    arguments ``divisible`` picks are marked 16-divisible, as the launcher's
    specialisation would mark them, so vectorisation and register use match
    a real launch; ``num_warps`` as the launcher chooses it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for arg in kernel.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = ptr_types.get(arg, ptr_types["*"])
        else:
            signature[arg] = "fp32" if arg in floats else "i32"
    aligned = [
        i
        for i, arg in enumerate(kernel.arg_names)
        if arg.endswith("_ptr") or (arg not in constexprs and divisible(arg))
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    options = {} if num_warps is None else {"num_warps": num_warps}
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
