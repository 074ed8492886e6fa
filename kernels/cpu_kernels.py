"""Tandem's compiled CPU kernels: one C++ extension, built on first use.

Sources live in `kernels/csrc/`:

* `decode_attention.cpp`: the decode part of paged attention. Decode on a
  CPU is bound by memory bandwidth: each step reads every running
  sequence's whole K/V context once. The pure-torch path reads it three
  times (gather into a padded buffer, write it, read it again in SDPA);
  this kernel walks the block table and reads each K/V row once, in place,
  with an online softmax per (sequence, KV head) and all query heads of a
  GQA group sharing each row. Under a sliding window (`window` > 0) it
  starts at the first in-window key and never reads the blocks before it.
* `prefill_attention.cpp`: the prefill part of paged attention (AVX-512
  builds): every prefill chunk of a batch in one call, causal over its
  cached prefix and itself, K/V read in place through the block table and
  keys past a query's position skipped (torch's CPU flash attention, the
  fallback, computes them and masks them out at prompt lengths under 512);
  under a sliding window, the keys before each tile's window too.
  `prefill_attention_amx.cpp` runs the same attention over a bfloat16
  cache on AMX tiles (oneDNN's brgemm through ATen) where the CPU has them.
* `fused_ops.cpp`: RMSNorm (with the residual add folded in), SiLU-and-mul
  and RoPE, each one pass instead of a chain of torch kernels (see
  `kernels.elementwise`).
* `decode_stack.cpp`: the decoder's whole layer loop for decode steps of a
  few sequences, calling the kernels above from C++ (one call per forward
  pass instead of a dozen Python-driven calls per layer).
* `kv_int8.cpp`: the int8 KV cache's writer (`cache_kv_int8`): float32
  K/V rows quantized into their slots, bit for bit as `kernels.kv_int8`'s
  reference quantizer (format and rounding there and in `kv_int8.h`). The
  decode and prefill kernels above read that cache in place, converting
  each row and applying its scale in registers.
* `kv_copy.cpp`: whole-KV-block copies between the paged cache and
  connector frames, optionally with the frames' xxh3-64 checksums computed
  in the same pass (xxHash's single header, vendored under
  `csrc/third_party/xxhash/`, BSD-2-Clause).
* `quant_pack.cpp`, `quant_linear.cpp`, `quant_gemm.cpp`,
  `quant_linear_int8.cpp`, `quant_linear_bf16.cpp`, `quant_linear_amx.cpp`,
  `amx_mlp.cpp`: linear layers over GGUF
  Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks,
  int8 and bfloat16 weights in tiles of 8 output rows
  (`quant_tiles.h`; see `kernels.quant`), with float32 or (opted in) int8
  activations; AVX2 paths (with AVX-512 VNNI's integer dot products and
  AVX512_BF16's bfloat16 ones where the CPU has them), AMX tiles for
  prefill-sized calls (and a gated MLP's whole pass) where it has those, and
  a portable fallback.
* `shm_index.cpp`: the slot index of the shared-memory KV pool (lookup,
  LRU touches, victim choice, publishing), which `connectors.shm_pool`
  otherwise runs in numpy.

Compute is float32 except where a weight format opts out (`kernels.quant`: int8
activations, bfloat16 dot products) and in prefill attention over a
bfloat16 KV cache on CPUs with AVX512_BF16 (bfloat16 products, float32
sums: `prefill_attention.cpp`, on AMX tiles `prefill_attention_amx.cpp`).
The extension is built with torch's C++ extension tooling (a compiler and
ninja are needed; about a minute, then cached under torch's extension
directory, keyed by the sources). If it cannot be built,
`load()` returns None once, logs why, and the torch paths run as before.
``TANDEM_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (
    "bindings.cpp",
    "decode_attention.cpp",
    "decode_stack.cpp",
    "fused_ops.cpp",
    "kv_copy.cpp",
    "kv_int8.cpp",
    "prefill_attention.cpp",
    "prefill_attention_amx.cpp",
    "quant_linear.cpp",
    "quant_gemm.cpp",
    "amx_mlp.cpp",
    "quant_linear_int8.cpp",
    "quant_linear_amx.cpp",
    "quant_linear_bf16.cpp",
    "quant_pack.cpp",
    "shm_index.cpp",
)
# Included by the sources: part of the module's name, though not compiled alone.
_HEADERS = (
    "cpu_ops.h",
    "decode_stack.h",
    "kv_copy.h",
    "kv_int8.h",
    "kv_layout.h",
    "quant_expand.h",
    "silu.h",
    "quant_int8_rows.h",
    "quant_tiles.h",
    "shm_index.h",
    "third_party/xxhash/xxhash.h",
)

# The head sizes the decode kernel is instantiated for (others use the torch path).
HEAD_DIMS = (64, 128, 256)

_STATE: dict[str, ModuleType | None] = {}


def load() -> ModuleType | None:
    """The compiled module, or None if it is disabled or cannot be built."""
    if "module" in _STATE:
        return _STATE["module"]
    module = None
    if os.environ.get("TANDEM_CPU_KERNELS", "1") != "0":
        module = _build()
    _STATE["module"] = module
    return module


def _extension_name() -> str:
    """Named after its sources and where they are: checkouts of Tandem on one
    machine share torch's extension cache, and one must never load another
    version's module, nor rebuild the module of another checkout (torch's
    build files name the sources' paths, so a shared name would be rebuilt
    each time a process from the other checkout starts)."""
    digest = hashlib.sha256(str(_CSRC.resolve()).encode())
    for name in _SOURCES + _HEADERS:
        digest.update((_CSRC / name).read_bytes())
    return f"tandem_cpu_kernels_{digest.hexdigest()[:12]}"


def _build() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load as load_extension

        name = _extension_name()
        logger.info("loading Tandem's CPU kernels (built on first use: ~1 min)")
        with build_lock(name):
            module: ModuleType = load_extension(
                name=name,
                sources=[str(_CSRC / name) for name in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        return module
    except Exception as exc:  # a missing compiler must not stop serving
        logger.warning("CPU kernels unavailable (%s); using the torch paths", exc)
        return None


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Held while torch loads (and maybe builds) extension `name`.

    torch's own lock is a file whose existence is the lock: a build that is
    killed (OOM, SIGKILL) leaves it, and every later load waits on it
    forever. This lock is an flock, which the kernel drops when its holder
    dies; whoever holds it is the only Tandem process in torch's build
    directory, so a torch lock found there was left by a dead build and is
    removed."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir.parent / f"{name}.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


if __name__ == "__main__":
    # `python -m kernels.cpu_kernels` (make's set-up): build once per checkout,
    # so the first server or test does not wait for the compiler.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ready = load() is not None
    print("Tandem CPU kernels:", "ready" if ready else "unavailable (the torch paths serve)")
