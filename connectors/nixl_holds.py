"""A prefill pod's holds: a finished request's blocks kept for one READ.

A hold names its request, a 128-bit nonce drawn when the blocks are offered,
and exactly the blocks offered. The nonce travels in the request's
kv_transfer_params to the router and on to one decode pod; nobody else
learns it.

A NIXL READ is one-sided: the producer cannot refuse it, and bytes read
after the hold ended may be another request's KV. So a consumer uses what
it read only once the producer *confirms* the hold: it presents (request
id, nonce, the hold's block ids as its params listed them) through the
side channel (``ReleaseHold``), and the answer is HELD only if that very
hold is still in this table with exactly those blocks in that order. (A
consumer with a local prefix hit reads only the tail of that list; the
whole list binds each block it read to its position, so params that
reorder or swap a hold's own blocks are refused too.) That proves
the READ saw the right bytes: a hold leaves the table exactly once, and its
blocks are freed (and may be reused) only after it left. Any other answer
(the lease lapsed, the transfer timeout passed, the service released it,
the ids or blocks do not match a hold: forged params) and the consumer
recomputes instead.

Shared by two threads: the engine thread adds holds and, at each poll,
collects the ones that ended (their blocks can go); the side channel's
handler confirms them. Hence the lock; every method takes it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any

from engine.kv_transfer.base import Claim

logger = logging.getLogger(__name__)

# A reject that beats the hold it is about is kept this long; so is the
# memory of an ended hold (a claim for it is then GONE, not UNKNOWN).
EARLY_SECONDS = 60.0
NONCE_HEX = 32  # 128 bits


@dataclass(frozen=True)
class HoldClaim:
    """What a consumer presents to release a hold it has read."""

    request_id: str
    nonce: str
    block_ids: tuple[int, ...]

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, payload: bytes) -> HoldClaim:
        """Raises ValueError naming what is malformed."""
        try:
            data = json.loads(payload)
            claim = cls(str(data["request_id"]), str(data["nonce"]), tuple(data["block_ids"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed hold claim: {e}") from None
        if not all(isinstance(b, int) for b in claim.block_ids):
            raise ValueError("malformed hold claim: block_ids must be integers")
        return claim


@dataclass
class _Hold:
    nonce: str
    block_ids: tuple[int, ...]
    lease_until: float
    hard_until: float


class HoldTable:
    def __init__(self, lease: float, timeout: float) -> None:
        self.lease = lease
        self.timeout = timeout
        self._holds: dict[str, _Hold] = {}
        self._ended: set[str] = set()  # left the table since the last take_ended
        self._early: dict[tuple[str, str], float] = {}  # (id, nonce) rejected before added
        self._gone: dict[tuple[str, str], float] = {}  # (id, nonce) of ended holds
        self._lock = threading.Lock()
        self.leases_lapsed = 0  # counted by take_ended; the worker reads it

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def __contains__(self, req_id: object) -> bool:
        with self._lock:
            return req_id in self._holds

    def add(self, req_id: str, nonce: str, block_ids: tuple[int, ...], now: float) -> None:
        with self._lock:
            self._holds[req_id] = _Hold(nonce, block_ids, now + self.lease, now + self.timeout)
            if self._early.pop((req_id, nonce), None) is not None:
                self._end(req_id, now)

    def heartbeat(self, req_id: str, nonce: str, now: float) -> bool:
        """Extends the lease; False if there is no such hold."""
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is None or hold.nonce != nonce:
                return False
            hold.lease_until = min(now + self.lease, hold.hard_until)
            return True

    def reject(self, req_id: str, nonce: str | None, now: float) -> None:
        """Nobody will read the hold (a consumer's ``reject``, nonce given;
        this pod's service, by id alone). One for a hold not added yet is
        kept for it."""
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is not None and nonce in (None, hold.nonce):
                self._end(req_id, now)
            elif hold is None and nonce is not None:
                self._early[(req_id, nonce)] = now

    def claim(self, claim: HoldClaim, now: float) -> Claim:
        """A consumer read (some of) the hold's blocks: HELD (and released)
        if the hold is live and matches exactly; else GONE or UNKNOWN."""
        with self._lock:
            hold = self._holds.get(claim.request_id)
            if hold is None:
                key = (claim.request_id, claim.nonce)
                return Claim.GONE if key in self._gone else Claim.UNKNOWN
            if hold.nonce != claim.nonce or hold.block_ids != claim.block_ids:
                logger.warning(
                    "refusing a claim on the hold of %s: its nonce or blocks do not match",
                    claim.request_id,
                )
                return Claim.GONE
            self._end(claim.request_id, now)
            return Claim.HELD

    def take_ended(self, now: float) -> set[str]:
        """The holds that ended since the last call (lapsed ones included,
        ended here): their blocks can be freed."""
        with self._lock:
            for req_id, hold in list(self._holds.items()):
                if now >= min(hold.lease_until, hold.hard_until):
                    why = "lease lapsed" if now < hold.hard_until else "transfer timeout"
                    logger.warning("freeing KV blocks of %s nobody fetched (%s)", req_id, why)
                    self.leases_lapsed += 1
                    self._end(req_id, now)
            for memory in (self._early, self._gone):
                for key, when in list(memory.items()):
                    if now - when > EARLY_SECONDS:
                        del memory[key]
            ended, self._ended = self._ended, set()
            return ended

    def _end(self, req_id: str, now: float) -> None:
        hold = self._holds.pop(req_id)
        self._gone[(req_id, hold.nonce)] = now
        self._ended.add(req_id)


CLAIM_METHOD = "/tandem.v1.KVTransfer/ReleaseHold"


class ClaimSender:
    """Sends claims (ReleaseHold) to producers, one kept channel each: a
    claim per hand-over would otherwise open a connection per request.
    Thread-safe; blocking calls, for a helper thread."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._calls: dict[str, Any] = {}
        self._channels: list[Any] = []
        self._lock = threading.Lock()

    def send(self, address: str, claim: HoldClaim) -> Claim:
        """HELD or GONE; raises grpc.RpcError if the producer does not
        answer. Sends $TANDEM_API_KEY as a bearer token when set (pods of
        one deployment share it)."""
        from google.protobuf import wrappers_pb2

        metadata = []
        if key := os.environ.get("TANDEM_API_KEY"):
            metadata.append(("authorization", f"Bearer {key}"))
        request = wrappers_pb2.BytesValue(value=claim.to_bytes())
        # wait_for_ready: a kept channel to a producer that restarted on the
        # same address is in reconnect backoff; fail-fast would call the
        # live new incarnation unreachable.
        call = self._call(address)
        reply = call(request, timeout=self.timeout, metadata=metadata, wait_for_ready=True)
        return Claim.HELD if reply.value else Claim.GONE

    def _call(self, address: str) -> Any:
        import grpc
        from google.protobuf import wrappers_pb2

        with self._lock:
            call = self._calls.get(address)
            if call is None:
                channel = grpc.insecure_channel(address)
                self._channels.append(channel)
                call = channel.unary_unary(
                    CLAIM_METHOD,
                    request_serializer=wrappers_pb2.BytesValue.SerializeToString,
                    response_deserializer=wrappers_pb2.BoolValue.FromString,
                )
                self._calls[address] = call
            return call

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._calls.clear()
