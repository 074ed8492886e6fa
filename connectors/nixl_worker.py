"""The worker half of NixlConnector: leases on the producer, READs on the consumer.

Producer (prefill pod): a finished do_remote_decode request's blocks are
*held* (``connectors.nixl_holds``: a hold has a nonce, and only a consumer
presenting it with the hold's exact blocks can claim it). The hold ends when
the consumer claims it after its READ (the side channel's ``ReleaseHold``),
when the consumer rejects the request (``reject``; or this pod's service
does, through ``release``, when the router saw the decode leg refused before
any consumer engine took it), when the lease lapses (no ``hb`` heartbeat for
``lease`` seconds), or ``timeout`` seconds after it began whatever the
heartbeats say. Either way the request is reported in ``finished_sending``
and the scheduler frees its blocks: none is stranded.

Consumer (decode pod): for each request that will read, the peer's handshake
starts as soon as the request arrives (``awaiting``) and heartbeats go out
every ``lease / 3`` seconds until the READ is over. A READ is posted once the
blocks are allocated (``recvs``) and polled every step; once it is done, the
hold is claimed (``claim``, a gRPC call on a helper thread), and only a
HELD answer delivers the blocks. Any failure (peer unreachable or
incompatible, peer restarted, transfer error, the hold ended before the
claim, ``timeout``) reports the request's blocks as invalid, and the
scheduler recomputes them: bytes that were not confirmed are never used.

Notifications (consumer to producer, over NIXL): ``hb:<items>`` and
``reject:<items>``, each item the hold's nonce (32 hex digits) then the
request id, comma-separated.

Both sides count what went wrong (``take_stats``): holds freed unread
(``leases_lapsed``) and failed READs by kind (``engine.stats.TransferFailure``).

All NIXL calls run on the engine thread; only the gRPC handshake runs on a
helper thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from connectors.nixl_endpoint import NixlEndpoint, Peer
from connectors.nixl_handshake import PeerInfo, incompatibility
from connectors.nixl_holds import NONCE_HEX, HoldClaim, HoldTable
from engine.kv_transfer.base import Claim
from engine.kv_transfer.params import KVTransferParams
from engine.stats import KVConnectorStats, TransferFailure

logger = logging.getLogger(__name__)

# A failed handshake is retried (for a new request) after this long.
HANDSHAKE_RETRY_SECONDS = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class RemoteSource:
    """Where a consumer request's KV is: the producer's kv_transfer_params."""

    address: str  # the producer's side channel (its gRPC host:port)
    agent_name: str
    request_id: str  # the producer's id for the request
    block_ids: tuple[int, ...]  # its prompt blocks, in order (the last may be partial)
    num_tokens: int  # prompt tokens those blocks hold
    compat_hash: str
    nonce: str  # the producer's hold: presented to claim it

    @property
    def item(self) -> bytes:
        """This hold in a notification."""
        return (self.nonce + self.request_id).encode()

    @classmethod
    def from_params(cls, params: KVTransferParams) -> RemoteSource:
        """Raises ValueError naming the first missing key (the types were
        checked when the params were made)."""
        return cls(
            address=_required(params.remote_address, "remote_address"),
            agent_name=_required(params.remote_agent, "remote_agent"),
            request_id=_required(params.remote_request_id, "remote_request_id"),
            block_ids=_required(params.remote_block_ids, "remote_block_ids"),
            num_tokens=_required(params.remote_num_tokens, "remote_num_tokens"),
            compat_hash=_required(params.remote_compat, "remote_compat"),
            nonce=_nonce(_required(params.remote_hold, "remote_hold")),
        )


def _nonce(value: str) -> str:
    if len(value) != NONCE_HEX or not all(c in "0123456789abcdef" for c in value):
        raise ValueError(f"kv_transfer_params remote_hold: expected {NONCE_HEX} hex digits")
    return value


def _required(value: T | None, key: str) -> T:
    if value is None:
        raise ValueError(f"kv_transfer_params lacks {key!r}")
    return value


@dataclass
class RecvSpec:
    req_id: str
    source: RemoteSource
    local_ids: list[int]
    remote_ids: list[int]


@dataclass
class _Read:
    spec: RecvSpec
    deadline: float
    handle: Any = None
    # Once the READ is done: the producer's answer to our claim on the hold.
    claim: Future[Claim] | None = None


@dataclass(frozen=True)
class _Outcome:
    """How a READ ended: ``failure`` None once it delivered the blocks."""

    failure: TransferFailure | None
    why: str


_DONE = _Outcome(None, "done")
# The request finished before its READ ended: nothing to fail.
_ABANDONED = _Outcome(None, "request finished before its transfer")


@dataclass
class _PeerSlot:
    """What we know of the engine at one address."""

    peer: Peer | None = None
    # A peer refused for transfers (incompatible) is still told "reject".
    notify_only: str | None = None
    future: Future[PeerInfo] | None = None
    error: _Outcome | None = None
    error_at: float = 0.0
    # Agent names a fetch was started for: a source naming one of these
    # that the fetch did not find is from a gone incarnation.
    asked: set[str] = field(default_factory=set)


class NixlWorker:
    def __init__(
        self,
        endpoint: NixlEndpoint,
        compat: dict[str, Any],
        lease: float,
        timeout: float,
        fetch: Callable[[str], PeerInfo],
        claim: Callable[[str, HoldClaim], Claim],
    ) -> None:
        """``fetch``: a peer's handshake, by address; ``claim``: present a
        claim to the producer at an address (both blocking: they run on a
        helper thread)."""
        self.endpoint = endpoint
        self.compat = compat
        self.lease = lease
        self.timeout = timeout
        self._fetch = fetch
        self._claim = claim
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="nixl-handshake")
        # producer
        self.holds = HoldTable(lease, timeout)
        self._lapsed_seen = 0
        self.ignored_notifs = 0
        # consumer
        self.awaiting: dict[str, RemoteSource] = {}
        self.reads: dict[str, _Read] = {}
        self.slots: dict[str, _PeerSlot] = {}
        self._invalid: set[int] = set()
        self._next_heartbeat = 0.0
        # both: what went wrong since take_stats last ran
        self._stats = KVConnectorStats()

    # ---- instructions from the scheduler half -----------------------------

    def hold(self, req_id: str, nonce: str, block_ids: tuple[int, ...], now: float) -> None:
        self.holds.add(req_id, nonce, block_ids, now)

    def release(self, req_id: str) -> None:
        """Nobody will read ``req_id``'s held blocks: free them at the next
        poll, exactly as a consumer's ``reject`` would."""
        self.holds.reject(req_id, None, time.monotonic())

    def claim(self, payload: bytes) -> Claim:
        """The side channel's ReleaseHold (any thread): a consumer read the
        blocks; raises ValueError for a malformed claim."""
        return self.holds.claim(HoldClaim.from_bytes(payload), time.monotonic())

    def expect(self, req_id: str, source: RemoteSource) -> None:
        """A request will read from ``source``: handshake now, heartbeat on."""
        self.awaiting[req_id] = source
        self._resolve(source, time.monotonic())

    def receive(self, spec: RecvSpec, now: float) -> None:
        self.awaiting.setdefault(spec.req_id, spec.source)
        self.reads[spec.req_id] = _Read(spec, deadline=now + self.timeout)

    def end(self, req_id: str) -> None:
        """No READ will come for ``req_id`` (finished, or nothing to load):
        tell the producer to free, unless a READ is under way."""
        source = self.awaiting.pop(req_id, None)
        if source is not None and req_id not in self.reads:
            self._tell(source, b"reject")

    # ---- polled every step --------------------------------------------------

    def poll(self, finished: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving). ``finished``: requests the
        scheduler finished this step; a READ of theirs is abandoned or, if
        under way, waited for, then reported in finished_sending."""
        now = time.monotonic()
        sending = self._poll_holds(now)
        done, released = self._poll_reads(now, finished)
        if self.awaiting and now >= self._next_heartbeat:
            self._heartbeat(now)
            self._next_heartbeat = now + self.lease / 3
        return sending | released, done

    def poll_idle(self) -> None:
        """The engine is idle (no holds, no reads): progress NIXL, so a
        peer's READ of blocks we no longer hold ends, and heed its
        notifications."""
        self._take_notifs(time.monotonic())

    def take_invalid(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def take_stats(self) -> KVConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVConnectorStats()
        return stats

    # ---- producer -------------------------------------------------------------

    def _poll_holds(self, now: float) -> set[str]:
        self._take_notifs(now)
        released = self.holds.take_ended(now)
        lapsed = self.holds.leases_lapsed
        self._stats.leases_lapsed += lapsed - self._lapsed_seen
        self._lapsed_seen = lapsed
        return released

    def _take_notifs(self, now: float) -> None:
        for message in self.endpoint.take_notifs():
            kind, _, items = message.decode(errors="replace").partition(":")
            for item in items.split(","):
                self._on_notif(kind, item[:NONCE_HEX], item[NONCE_HEX:], now)

    def _on_notif(self, kind: str, nonce: str, req_id: str, now: float) -> None:
        if kind == "reject":
            self.holds.reject(req_id, nonce, now)
        elif kind != "hb" or not self.holds.heartbeat(req_id, nonce, now):
            self.ignored_notifs += 1
            logger.info("ignoring NIXL notification %s:%s (no such hold)", kind, req_id)

    # ---- consumer -------------------------------------------------------------

    def _poll_reads(self, now: float, finished: set[str]) -> tuple[set[str], set[str]]:
        done: set[str] = set()
        released: set[str] = set()
        for req_id, read in list(self.reads.items()):
            orphan = req_id in finished or req_id not in self.awaiting
            outcome = self._advance(read, now, abandon=orphan)
            if outcome is None:
                continue
            del self.reads[req_id]
            self.awaiting.pop(req_id, None)
            if outcome is not _DONE:
                self._tell(read.spec.source, b"reject")
                if not orphan:  # nobody computes with an orphan's blocks
                    logger.warning(
                        "KV transfer for %s failed (%s): recomputing", req_id, outcome.why
                    )
                    self._invalid.update(read.spec.local_ids)
                    self._stats.add_failure(outcome.failure or TransferFailure.TRANSFER_ERROR)
            (released if orphan else done).add(req_id)
        return done, released

    def _advance(self, read: _Read, now: float, abandon: bool) -> _Outcome | None:
        """None while the READ (or the claim after it) is pending; else how
        it ended."""
        if read.claim is not None:
            return _ABANDONED if abandon else self._claimed(read, now)
        if read.handle is None:
            if abandon:
                return _ABANDONED
            peer = self._resolve(read.spec.source, now)
            if isinstance(peer, _Outcome):
                return peer
            if peer is None:
                if now >= read.deadline:
                    return _Outcome(TransferFailure.TIMED_OUT, "handshake timed out")
                return None
            return self._post(read, peer)
        state = self.endpoint.state(read.handle)
        # An abandoned READ is aborted rather than waited for: it may never
        # end by itself (a READ progresses only while the producer polls
        # NIXL, and a producer told to free the blocks goes idle).
        if state == "PROC" and now < read.deadline and not abandon:
            return None
        if not self.endpoint.release(read.handle):  # aborts it if running
            return None  # NIXL still owns the blocks: try again next step
        read.handle = None
        if state == "DONE" and not abandon:
            # The bytes count only once the producer confirms it held them
            # throughout: claim the hold.
            source = read.spec.source
            # The whole list the params named: it binds each block read
            # (a tail of it, after a local prefix hit) to its position.
            claim = HoldClaim(source.request_id, source.nonce, source.block_ids)
            read.claim = self._pool.submit(self._claim, source.address, claim)
            return None
        if state == "ERR":
            return _Outcome(TransferFailure.TRANSFER_ERROR, "transfer error")
        if abandon:
            return _ABANDONED
        return _Outcome(TransferFailure.TIMED_OUT, "transfer timed out")

    def _claimed(self, read: _Read, now: float) -> _Outcome | None:
        """The producer's answer to our claim; None while it is on its way."""
        assert read.claim is not None
        if not read.claim.done():
            if now >= read.deadline:
                return _Outcome(TransferFailure.TIMED_OUT, "claiming the hold timed out")
            return None
        try:
            answer = read.claim.result()
        except Exception as e:
            return _Outcome(TransferFailure.PEER_UNREACHABLE, f"claiming the hold failed: {e}")
        if answer is Claim.HELD:
            return _DONE
        why = f"the producer no longer held the blocks ({answer.value})"
        return _Outcome(TransferFailure.HOLD_LOST, why)

    def _post(self, read: _Read, peer: Peer) -> _Outcome | None:
        spec = read.spec
        try:
            read.handle = self.endpoint.read(peer, spec.local_ids, spec.remote_ids, b"")
        except Exception as e:
            return _Outcome(TransferFailure.TRANSFER_ERROR, f"posting the READ failed: {e}")
        return None

    def _resolve(self, source: RemoteSource, now: float) -> Peer | _Outcome | None:
        """The peer holding ``source``'s blocks; None while the handshake
        runs; the failure when it cannot be had."""
        slot = self.slots.setdefault(source.address, _PeerSlot())
        if slot.future is not None:
            if not slot.future.done():
                return None
            self._finish_handshake(source.address, slot, now)
        if slot.peer is not None and slot.peer.info.agent_name == source.agent_name:
            return slot.peer
        if source.agent_name in slot.asked:
            if slot.error is not None:
                return slot.error
            current = slot.peer.info.agent_name if slot.peer is not None else "none"
            return _Outcome(
                TransferFailure.PEER_RESTARTED,
                f"peer {source.address} restarted: {source.agent_name} gone, now {current}",
            )
        if slot.error is not None and now - slot.error_at < HANDSHAKE_RETRY_SECONDS:
            return slot.error
        slot.asked.add(source.agent_name)
        slot.error = None
        slot.future = self._pool.submit(self._fetch, source.address)
        return None

    def _finish_handshake(self, address: str, slot: _PeerSlot, now: float) -> None:
        future, slot.future = slot.future, None
        assert future is not None
        try:
            info = future.result()
            problem = incompatibility(self.compat, info.compat)
            if problem is not None:
                self.endpoint.add_notify_only(info)
                slot.notify_only = info.agent_name
                why = f"NIXL peer {address} refused: incompatible KV cache: {problem}"
                slot.error = _Outcome(TransferFailure.PEER_INCOMPATIBLE, why)
            else:
                if slot.peer is not None:
                    self.endpoint.remove_peer(slot.peer.info.agent_name)
                    slot.peer = None
                slot.peer = self.endpoint.add_peer(info)
                logger.info("NIXL handshake with %s done (agent %s)", address, info.agent_name)
        except Exception as e:
            why = f"NIXL peer {address} refused: {e}"
            slot.error = _Outcome(TransferFailure.PEER_UNREACHABLE, why)
        if slot.error is not None:
            slot.error_at = now
            logger.error("%s", slot.error.why)

    def _heartbeat(self, now: float) -> None:
        """One hb message per producer naming every request still to read
        from it (resolving a handshake that finished meanwhile)."""
        by_agent: dict[str, list[bytes]] = {}
        for source in self.awaiting.values():
            peer = self._resolve(source, now)
            if not isinstance(peer, Peer):
                continue
            by_agent.setdefault(source.agent_name, []).append(source.item)
        for agent, items in by_agent.items():
            self.endpoint.notify(agent, b"hb:" + b",".join(items))

    def _tell(self, source: RemoteSource, kind: bytes) -> None:
        slot = self.slots.get(source.address)
        if slot is None:
            return
        known = {slot.notify_only, slot.peer.info.agent_name if slot.peer else None}
        if source.agent_name in known:
            self.endpoint.notify(source.agent_name, kind + b":" + source.item)

    def health(self) -> str | None:
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for read in self.reads.values():
            if read.handle is not None:
                self.endpoint.release(read.handle)
        self.endpoint.close()
