"""What a NIXL peer publishes about itself, and fetching it over gRPC.

A prefill pod publishes a ``PeerInfo``: its NIXL agent's name and metadata,
where each layer's KV cache lies in its memory, how many blocks it has, and
the facts two caches must share for a block to mean the same thing in both
(model, weight format, dtype, block size, layout, Tandem version). A decode
pod fetches it once per peer incarnation through
``tandem.v1.KVTransfer/GetHandshake`` on the peer's gRPC port, checks
compatibility, and then reads blocks directly.

The agent name carries the engine id, which is new on every start: a peer
that restarted is a new agent, never served from a stale entry.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from engine.kv_transfer.base import KVLayout

HANDSHAKE_METHOD = "/tandem.v1.KVTransfer/GetHandshake"
# The KV cache's memory layout, part of what peers must share.
CACHE_LAYOUT = "per layer [2, num_blocks, block_size, kv_heads, head_dim], contiguous"


class IncompatiblePeerError(RuntimeError):
    """The peer's KV cache cannot be read into ours; the message says why."""


def tandem_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown"


def compat_facts(model_name: str, layout: KVLayout) -> dict[str, Any]:
    """What two pods must agree on for a block to be copied between them:
    the model, the Tandem version, the cache's memory layout and every
    ``KVLayout`` fact, the weight format included (float32 and Q4_1
    weights give different KV for the same tokens)."""
    return {
        "model": model_name,
        "tandem": tandem_version(),
        "cache_layout": CACHE_LAYOUT,
        **asdict(layout),
    }


def compat_hash(facts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def incompatibility(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """None if the caches match; else each differing fact, theirs vs ours."""
    keys = sorted(set(ours) | set(theirs))
    diffs = [
        f"{k}: peer {theirs.get(k)!r}, here {ours.get(k)!r}"
        for k in keys
        if ours.get(k) != theirs.get(k)
    ]
    return "; ".join(diffs) or None


@dataclass(frozen=True)
class PeerInfo:
    """One engine incarnation's NIXL endpoint."""

    agent_name: str
    agent_metadata: bytes
    num_blocks: int
    half_bytes: int  # bytes of one block's K (or V) in one layer
    layer_addrs: tuple[int, ...]  # where each layer's cache tensor starts
    compat: dict[str, Any]
    mem_type: str = "DRAM"  # "VRAM" for a cache on a GPU
    device_id: int = 0  # that GPU's index

    def to_bytes(self) -> bytes:
        data = asdict(self)
        data["agent_metadata"] = base64.b64encode(self.agent_metadata).decode()
        return json.dumps(data).encode()

    @classmethod
    def from_bytes(cls, payload: bytes) -> PeerInfo:
        try:
            data = json.loads(payload)
            data["agent_metadata"] = base64.b64decode(data["agent_metadata"])
            data["layer_addrs"] = tuple(int(a) for a in data["layer_addrs"])
            return cls(**data)
        except (ValueError, KeyError, TypeError) as e:
            raise IncompatiblePeerError(f"malformed NIXL handshake from peer: {e}") from None


def fetch_peer_info(address: str, timeout: float) -> PeerInfo:
    """GetHandshake on ``address`` (host:port), blocking up to ``timeout``.
    Sends $TANDEM_API_KEY as a bearer token when set (pods of one
    deployment share it)."""
    import grpc
    from google.protobuf import wrappers_pb2

    metadata = []
    if key := os.environ.get("TANDEM_API_KEY"):
        metadata.append(("authorization", f"Bearer {key}"))
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            HANDSHAKE_METHOD,
            request_serializer=wrappers_pb2.StringValue.SerializeToString,
            response_deserializer=wrappers_pb2.BytesValue.FromString,
        )
        reply = call(wrappers_pb2.StringValue(value="nixl"), timeout=timeout, metadata=metadata)
    return PeerInfo.from_bytes(reply.value)
