"""The worker's side of LoRA: device slots and the host cache behind them.

Every adapted projection of the model gets ``max_loras`` device slots
(``LoRALayer``: stacked A and B, kernels/lora.py). A step names the adapters
its rows run under; ``activate`` makes sure each sits in a slot, copying it
in from the host cache (an LRU of ``max_cpu_loras`` adapters) and evicting
the slot used longest ago that this step does not need. An adapter that
fell out of the host cache is read from its directory again, and must
still be the same adapter (its digest is checked).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import cast

import torch

from engine.config import LoRAConfig
from engine.lora.adapter import LoRAAdapter, fused_shapes, read_adapter
from engine.lora.request import LoRARequest
from engine.models.layers import Linear
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kernels.lora import LoRALayer

logger = logging.getLogger(__name__)


def _projections(layer: LlamaDecoderLayer) -> dict[str, Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "qkv_proj": attn.qkv_proj,
        "o_proj": attn.o_proj,
        "gate_up_proj": mlp.gate_up_proj,
        "down_proj": mlp.down_proj,
    }


@dataclass
class SlotStats:
    """What filling slots cost, for benchmarks and logs."""

    slot_loads: int = 0
    disk_reads: int = 0
    load_seconds: float = 0.0


class LoRASlots:
    def __init__(self, config: LoRAConfig, model: LlamaForCausalLM) -> None:
        """Gives every adapted projection of ``model`` its (zeroed) slots."""
        self.config = config
        self.spec = model.spec
        self.state = model.lora_state
        weight = model.lm_head.weight
        self.layers: list[dict[str, LoRALayer]] = []
        shapes = fused_shapes(model.spec)
        rank = config.max_lora_rank
        for layer in model.model.layers:
            slots = {}
            for name, linear in _projections(cast(LlamaDecoderLayer, layer)).items():
                shape = shapes[name]
                width = len(shape.shard_outs) * rank
                dtype, device = weight.dtype, weight.device
                n = config.max_loras
                a = torch.zeros(n, width, shape.in_features, dtype=dtype, device=device)
                b = torch.zeros(n, shape.out_features, width, dtype=dtype, device=device)
                slots[name] = linear.lora = LoRALayer(a, b, self.state)
            self.layers.append(slots)
        self._known: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_ids = [0] * config.max_loras  # 0: empty
        self._slot_last_used = [0] * config.max_loras
        self._clock = 0
        self.stats = SlotStats()

    # --- adapters the engine knows -------------------------------------------------

    def add(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
        self._known[request.lora_int_id] = request
        self._cache(request.lora_int_id, adapter)

    def remove(self, lora_int_id: int) -> None:
        self._known.pop(lora_int_id, None)
        self._host.pop(lora_int_id, None)
        if lora_int_id in self._slot_ids:
            self._slot_ids[self._slot_ids.index(lora_int_id)] = 0

    @property
    def num_known(self) -> int:
        return len(self._known)

    def _cache(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_int_id] = adapter
        self._host.move_to_end(lora_int_id)
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)

    def _host_adapter(self, lora_int_id: int) -> LoRAAdapter:
        adapter = self._host.get(lora_int_id)
        if adapter is not None:
            self._host.move_to_end(lora_int_id)
            return adapter
        request = self._known[lora_int_id]
        adapter = read_adapter(request.lora_path, self.spec, self.config.max_lora_rank)
        if not request.cache_key.endswith(adapter.digest[:32]):
            raise RuntimeError(
                f"LoRA adapter {request.lora_name!r}: the files in {request.lora_path} "
                "changed since it was loaded; unload and load it again"
            )
        self.stats.disk_reads += 1
        self._cache(lora_int_id, adapter)
        return adapter

    # --- one step --------------------------------------------------------------------

    def activate(self, lora_int_ids: list[int]) -> dict[int, int]:
        """Slot of each adapter (distinct ids > 0) a step runs, loading those
        not in a slot yet."""
        if len(lora_int_ids) > len(self._slot_ids):
            raise RuntimeError(
                f"a step runs {len(lora_int_ids)} LoRA adapters: max_loras is "
                f"{len(self._slot_ids)} (the scheduler should never allow it)"
            )
        self._clock += 1
        wanted = set(lora_int_ids)
        slots = {}
        for lora_int_id in lora_int_ids:
            if lora_int_id in self._slot_ids:
                slot = self._slot_ids.index(lora_int_id)
            else:
                slot = self._free_slot(wanted)
                self._fill(slot, lora_int_id)
            self._slot_last_used[slot] = self._clock
            slots[lora_int_id] = slot
        return slots

    def _free_slot(self, wanted: set[int]) -> int:
        """An empty slot, else the one used longest ago this step can spare."""
        candidates = [i for i, lid in enumerate(self._slot_ids) if lid not in wanted]
        return min(candidates, key=lambda i: (self._slot_ids[i] != 0, self._slot_last_used[i]))

    def _fill(self, slot: int, lora_int_id: int) -> None:
        start = time.perf_counter()
        adapter = self._host_adapter(lora_int_id)
        for layer, weights in zip(self.layers, adapter.layers, strict=True):
            for name, lora in layer.items():
                pair = weights.get(name)
                if pair is None:
                    lora.a[slot].zero_()
                    lora.b[slot].zero_()
                else:
                    lora.a[slot].copy_(pair[0])
                    lora.b[slot].copy_(pair[1])
        self._slot_ids[slot] = lora_int_id
        self.stats.slot_loads += 1
        self.stats.load_seconds += time.perf_counter() - start
