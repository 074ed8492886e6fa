"""AdapterBudget: the seeds' ``max_loras`` rule for one step.

At most ``max_loras`` distinct LoRA adapters run in a step (the runner's
device slots). The running requests' adapters count first; a waiting
request that would add one more is skipped, not blocking the queue.
``max_loras`` 0: LoRA is off and every request fits.
``count_adapters`` gives the stats' requests per adapter name.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.request import Request


class AdapterBudget:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._step: set[int] = set()  # lora_int_id of the step's requests

    def start_step(self, running: Iterable[Request]) -> None:
        """The adapters of the requests already scheduled this step."""
        if self.max_loras:
            self._step = {r.lora_int_id for r in running if r.lora_int_id}
            assert len(self._step) <= self.max_loras

    def admits(self, request: Request) -> bool:
        lora = request.lora_int_id
        if not (self.max_loras and lora) or lora in self._step:
            return True
        return len(self._step) < self.max_loras

    def add(self, request: Request) -> None:
        if self.max_loras and request.lora_int_id:
            self._step.add(request.lora_int_id)


def count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per adapter name (base-model requests are not counted)."""
    counts: dict[str, int] = {}
    for request in requests:
        if (lora := request.lora_request) is not None:
            counts[lora.lora_name] = counts.get(lora.lora_name, 0) + 1
    return counts
