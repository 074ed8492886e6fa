"""AdapterBudget: the running requests' adapters count first; a new one
fits while fewer than max_loras are in the step; 0 means LoRA is off."""

from __future__ import annotations

from engine.lora.request import LoRARequest
from engine.request import Request
from engine.sched.adapter_budget import AdapterBudget
from tests.unit.engine.sched.harness import make_request


def _on(rid: str, lora: int | None) -> Request:
    request = make_request(rid, 4)
    if lora is not None:
        request.lora_request = LoRARequest(
            f"a{lora}", lora, f"/adapters/a{lora}", f"lora:{lora:032x}"
        )
    return request


def test_a_step_takes_at_most_max_loras_adapters() -> None:
    budget = AdapterBudget(2)
    budget.start_step([_on("r1", 1), _on("r2", None)])
    assert budget.admits(_on("r3", 1)) and budget.admits(_on("r4", None))
    second = _on("r5", 2)
    assert budget.admits(second)
    budget.add(second)
    assert not budget.admits(_on("r6", 3))
    assert budget.admits(_on("r7", 2)) and budget.admits(_on("r8", None))
    budget.start_step([])  # a new step starts empty
    assert budget.admits(_on("r9", 3))


def test_without_lora_every_request_fits() -> None:
    budget = AdapterBudget(0)
    budget.start_step([_on("r1", None)])
    assert budget.admits(_on("r2", None))
