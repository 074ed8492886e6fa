"""A NIXL agent over this engine's KV cache: registration, descriptors, READs.

Every layer's cache tensor is registered once. The descriptor list has one
entry per (layer, K or V, block): entry ``(layer * 2 + half) * num_blocks +
block``, ``half_bytes`` long. A request's READ names the entries of its
blocks on both sides, every layer's K and V at once, so one transfer moves a
request's whole KV (NIXL merges adjacent entries). The same list, built from
a peer's published addresses and block count, is prepared once per peer.

NIXL's progress thread busy-polls a core; it is off here. Transfers progress
when polled (``state``, ``take_notifs``), which the engine does every step,
and every few ms when idle.

Not thread-safe: one thread (the engine's) calls everything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from connectors.nixl_handshake import PeerInfo

logger = logging.getLogger(__name__)


def _import_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config) from the ``nixl`` meta package or
    the CUDA 12 build (``nixl-cu12``, which also moves host memory)."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError:
            raise ImportError(
                "kv_connector=nixl needs NIXL: pip install nixl-cu12 (or nixl)"
            ) from None
    return nixl_agent, nixl_agent_config


def descriptor_table(
    layer_addrs: Sequence[int], num_blocks: int, half_bytes: int, device_id: int = 0
) -> npt.NDArray[np.int64]:
    """[(layer * 2 + half) * num_blocks + block] -> (address, length, device)."""
    blocks = np.arange(num_blocks, dtype=np.int64) * half_bytes
    rows = []
    for base in layer_addrs:
        for half in range(2):
            start = base + half * num_blocks * half_bytes
            rows.append(np.stack([start + blocks, np.full_like(blocks, half_bytes)], axis=1))
    table = np.concatenate(rows)
    device = np.full((len(table), 1), device_id, dtype=np.int64)
    return np.ascontiguousarray(np.concatenate([table, device], axis=1))


def descriptor_indices(
    block_ids: Sequence[int], num_layers: int, num_blocks: int
) -> npt.NDArray[np.int32]:
    """The table entries of ``block_ids`` in every layer, K then V."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"block ids out of range 0..{num_blocks - 1}: {block_ids}")
    offsets = np.arange(num_layers * 2, dtype=np.int64)[:, None] * num_blocks
    return (offsets + ids[None, :]).reshape(-1).astype(np.int32)


@dataclass
class Peer:
    info: PeerInfo
    dlist: Any  # the prepared remote descriptor list


class NixlEndpoint:
    def __init__(self, agent_name: str, kv_caches: Sequence[torch.Tensor]) -> None:
        nixl_agent, nixl_agent_config = _import_nixl()
        first = kv_caches[0]
        self.name = agent_name
        self.num_layers = len(kv_caches)
        self.num_blocks = int(first.shape[1])
        self.half_bytes = first[0, 0].numel() * first.element_size()
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.device_id = (first.device.index or 0) if first.is_cuda else 0
        device_id = self.device_id
        self.agent = nixl_agent(
            agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self._registered = self.agent.register_memory(list(kv_caches))
        self.layer_addrs = tuple(int(c.data_ptr()) for c in kv_caches)
        table = descriptor_table(self.layer_addrs, self.num_blocks, self.half_bytes, device_id)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, self.mem_type)
        self.peers: dict[str, Peer] = {}

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, info: PeerInfo) -> Peer:
        """Loads a peer's agent and prepares its descriptor list (raises on
        a malformed one)."""
        self.remove_peer(info.agent_name)
        name = self.agent.add_remote_agent(info.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            table = descriptor_table(
                info.layer_addrs, info.num_blocks, info.half_bytes, info.device_id
            )
            dlist = self.agent.prep_xfer_dlist(name, table, info.mem_type)
        except Exception:
            self.agent.remove_remote_agent(name)
            raise
        peer = Peer(info, dlist)
        self.peers[info.agent_name] = peer
        return peer

    def add_notify_only(self, info: PeerInfo) -> None:
        """Loads a peer's agent to send it messages only (a peer refused
        for transfers must still hear that its blocks are not wanted)."""
        if info.agent_name not in self.peers:
            self.agent.add_remote_agent(info.agent_metadata)

    def remove_peer(self, agent_name: str) -> None:
        peer = self.peers.pop(agent_name, None)
        if peer is None:
            return
        try:
            self.agent.release_dlist_handle(peer.dlist)
            self.agent.remove_remote_agent(agent_name)
        except Exception as e:  # a peer that vanished: nothing left to undo
            logger.debug("removing NIXL peer %s: %s", agent_name, e)

    def read(
        self, peer: Peer, local_ids: Sequence[int], remote_ids: Sequence[int], notif: bytes
    ) -> Any:
        """Posts one READ of ``remote_ids`` (the peer's blocks) into
        ``local_ids``; the peer gets ``notif`` once it is done. Returns the
        transfer handle; raises if NIXL refuses to post it."""
        local = descriptor_indices(local_ids, self.num_layers, self.num_blocks)
        remote = descriptor_indices(remote_ids, self.num_layers, peer.info.num_blocks)
        handle = self.agent.make_prepped_xfer(
            "READ", self._local, local, peer.dlist, remote, notif_msg=notif
        )
        if self.agent.transfer(handle) == "ERR":
            self.release(handle)
            raise RuntimeError("NIXL refused to post the READ")
        return handle

    def state(self, handle: Any) -> str:
        """ "DONE", "PROC" or "ERR" (a lost peer raises inside NIXL: ERR)."""
        try:
            return str(self.agent.check_xfer_state(handle))
        except Exception as e:
            logger.warning("NIXL transfer failed: %s", e)
            return "ERR"

    def release(self, handle: Any) -> bool:
        """Frees a transfer (aborting it if still running); False if NIXL
        could not, so its buffers must stay untouched."""
        try:
            self.agent.release_xfer_handle(handle)
            return True
        except Exception as e:
            logger.warning("NIXL could not release a transfer: %s", e)
            return False

    def notify(self, agent_name: str, message: bytes) -> None:
        try:
            self.agent.send_notif(agent_name, message)
        except Exception as e:  # best effort: leases cover a lost message
            logger.debug("NIXL notification to %s failed: %s", agent_name, e)

    def take_notifs(self) -> list[bytes]:
        try:
            notifs = self.agent.get_new_notifs()
        except Exception as e:
            logger.warning("reading NIXL notifications failed: %s", e)
            return []
        return [m for messages in notifs.values() for m in messages]

    def close(self) -> None:
        for name in list(self.peers):
            self.remove_peer(name)
        try:
            self.agent.release_dlist_handle(self._local)
            self.agent.deregister_memory(self._registered)
        except Exception as e:
            logger.debug("closing the NIXL agent: %s", e)
