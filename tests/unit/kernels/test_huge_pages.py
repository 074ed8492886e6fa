"""kernels/huge_pages.py: one buffer advised MADV_HUGEPAGE, tensors moved into it in place."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from kernels.huge_pages import HUGE_PAGE, huge_page_buffer, move_to_huge_pages


def _vm_flags(address: int) -> list[str]:
    """The smaps VmFlags of the mapping holding `address` (Linux)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_buffer_starts_on_a_huge_page_and_is_zeroed() -> None:
    buffer = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE + 5
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert int(buffer.count_nonzero()) == 0
    buffer.fill_(7)  # writable to its last byte
    assert int(buffer[-1]) == 7


@pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE")
    or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="needs Linux with transparent huge pages",
)
def test_buffer_is_advised_huge_pages() -> None:
    buffer = huge_page_buffer(HUGE_PAGE)
    assert "hg" in _vm_flags(buffer.data_ptr())  # smaps' flag for MADV_HUGEPAGE


def test_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        huge_page_buffer(-1)


def test_tensors_keep_their_values_and_identity() -> None:
    torch.manual_seed(0)
    tensors = [
        torch.randint(0, 255, (1000, 37), dtype=torch.uint8),
        torch.randn(33, 7),
        torch.randn(5).to(torch.bfloat16),
        torch.arange(3, dtype=torch.int64),
    ]
    holder = {"weight": tensors[1]}  # another holder of the same tensor object
    before = [t.clone() for t in tensors]
    moved = move_to_huge_pages([*tensors, tensors[0]])  # listed twice: moved once
    assert moved == sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
    storage = tensors[0].untyped_storage().data_ptr()
    for t, want in zip(tensors, before, strict=True):
        assert torch.equal(t, want)
        assert t.untyped_storage().data_ptr() == storage  # all in the one buffer
        assert t.data_ptr() % 64 == 0
    assert holder["weight"].data_ptr() == tensors[1].data_ptr()
    # Writes through one tensor stay inside it.
    tensors[1].zero_()
    assert torch.equal(tensors[0], before[0]) and torch.equal(tensors[2], before[2])


def test_nothing_to_move() -> None:
    assert move_to_huge_pages([]) == 0


def test_a_strided_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="contiguous CPU"):
        move_to_huge_pages([torch.randn(4, 4).t()])
