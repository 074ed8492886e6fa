"""LoRARequest: which adapter a request runs under (vLLM's name)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter as the engine knows it once loaded.

    ``lora_int_id`` (> 0; 0 means the base model) is unique for the
    engine's lifetime, never reused, so an adapter unloaded and loaded again
    under the same name is a different adapter to the scheduler and the
    slots. ``cache_key`` is what block hashes carry: derived from the
    adapter's files, so KV computed under it is found again only under the
    same weights, on any pod (connectors, the router) and after a restart.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    cache_key: str
    rank: int = 0
