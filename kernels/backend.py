"""Choosing which implementations a model runs: the two attention ops
(`select_backend`) and the per-layer ops (`select_layer_ops`).

Precedence: an explicit name, then `TANDEM_ATTENTION_BACKEND`, then the
device's default: Triton on CUDA (and on CPU when `TRITON_INTERPRET=1`, i.e.
when someone is deliberately exercising the kernels in Triton's
interpreter), the vectorised torch path otherwise.

Triton is imported only when its backend is chosen, so CPU-only installs
whose triton cannot load still run the torch path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import cpu_kernels
from kernels.layer_ops import TORCH_OPS, LayerOps, compiled_ops
from kernels.metadata import AttentionMetadata

ENV_VAR = "TANDEM_ATTENTION_BACKEND"
BACKEND_NAMES = ("torch", "triton", "reference")

ReshapeAndCache = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class PagedAttention(Protocol):
    """`paged_attention(query, kv_cache, meta, scale, sliding_window=None)`;
    a Protocol, not a Callable alias, because the window is an optional
    keyword (semantics in `kernels.reference`)."""

    def __call__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionBackend:
    """The two attention ops, with the signatures of `kernels.reference`."""

    name: str
    reshape_and_cache: ReshapeAndCache
    paged_attention: PagedAttention


def select_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """The backend called `name`, else the one named by the environment,
    else the default for `device`. Raises ValueError for an unknown name."""
    chosen = name or os.environ.get(ENV_VAR) or _default_name(device)
    if chosen == "torch":
        from kernels import torch_attention as ops

        if device.type == "cpu":
            # Build (or load) the compiled decode kernel now, at engine start,
            # rather than inside the first request's first decode step.
            cpu_kernels.load()
    elif chosen == "triton":
        from kernels import triton_attention as ops  # type: ignore[no-redef]
    elif chosen == "reference":
        from kernels import reference as ops  # type: ignore[no-redef]
    else:
        known = ", ".join(BACKEND_NAMES)
        raise ValueError(f"unknown attention backend {chosen!r} (known: {known})")
    return AttentionBackend(chosen, ops.reshape_and_cache, ops.paged_attention)


def _default_name(device: torch.device) -> str:
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "torch"


def select_layer_ops(dtype: torch.dtype, device: torch.device) -> LayerOps:
    """Triton's fused ops on CUDA (kernels/triton_layer_ops.py: one launch
    each); the compiled ops for float32 on CPU when they build; else torch's."""
    if device.type == "cuda":
        # Imported here: triton is loaded only where it runs.
        from kernels.triton_layer_ops import TRITON_LAYER_OPS

        return TRITON_LAYER_OPS
    if dtype == torch.float32 and device.type == "cpu":
        module = cpu_kernels.load()
        if module is not None:
            return compiled_ops(module)
    return TORCH_OPS
