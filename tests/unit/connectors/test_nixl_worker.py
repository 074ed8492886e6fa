"""NixlWorker over two real NIXL agents (UCX, host memory) in one process.

The handshake fetch is injected (the gRPC side channel is covered by
tests/integration/test_nixl.py); everything else is the real thing: READs
between two registered caches with different block counts, notifications,
leases and heartbeats, refusals.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from connectors.nixl_handshake import (
    IncompatiblePeerError,
    PeerInfo,
    compat_facts,
    incompatibility,
)
from connectors.nixl_holds import HoldClaim
from connectors.nixl_worker import RecvSpec, RemoteSource
from engine.kv_transfer.base import Claim, KVLayout
from engine.stats import TransferFailure

# Seconds each (the real model, the Triton interpreter, child processes or
# Helm renders): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow

nixl_endpoint = pytest.importorskip("connectors.nixl_endpoint")
pytest.importorskip("nixl_cu12", reason="nixl-cu12 not installed")

from connectors.nixl_endpoint import (  # noqa: E402
    NixlEndpoint,
    descriptor_indices,
    descriptor_table,
)
from connectors.nixl_worker import NixlWorker  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
COMPAT = compat_facts("test-model", LAYOUT)
ADDRESS = "10.0.0.1:50051"  # never dialled: the fetch is injected


def _caches(num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=gen) for _ in range(LAYOUT.num_layers)]


class Pair:
    """A producer (8 blocks) and a consumer (6 blocks) worker."""

    def __init__(self, lease: float = 5.0, timeout: float = 30.0) -> None:
        self.prod_caches = _caches(8, 1)
        self.cons_caches = _caches(6, 2)
        prod = NixlEndpoint(f"prod-{id(self)}", self.prod_caches)
        cons = NixlEndpoint(f"cons-{id(self)}", self.cons_caches)
        self.info = PeerInfo(
            prod.name, prod.metadata(), prod.num_blocks, prod.half_bytes, prod.layer_addrs, COMPAT
        )
        self.fetches = 0
        self.serve: Callable[[], PeerInfo] = lambda: self.info
        self.producer = NixlWorker(
            prod, COMPAT, lease, timeout, fetch=self._never, claim=self._no_claims
        )
        self.consumer = NixlWorker(
            cons, COMPAT, lease, timeout, fetch=self._fetch, claim=self._claim
        )
        self.claims: list[HoldClaim] = []
        # What the current pump() has seen so far, for its `until`.
        self.sent: set[str] = set()
        self.released: set[str] = set()
        self.done: set[str] = set()

    def _fetch(self, address: str) -> PeerInfo:
        assert address == ADDRESS
        self.fetches += 1
        return self.serve()

    def _never(self, address: str) -> PeerInfo:
        raise AssertionError("the producer never fetches")

    def _claim(self, address: str, claim: HoldClaim) -> Claim:
        """The side channel's ReleaseHold, in process (UNKNOWN: the
        servicer would wait, then answer no)."""
        assert address == ADDRESS
        self.claims.append(claim)
        answer = self.producer.claim(claim.to_bytes())
        return Claim.HELD if answer is Claim.HELD else Claim.GONE

    def _no_claims(self, address: str, claim: HoldClaim) -> Claim:
        raise AssertionError("the producer never claims")

    def source(self, req: str = "r1", agent: str | None = None) -> RemoteSource:
        agent = agent or self.info.agent_name
        return RemoteSource(ADDRESS, agent, req, (5, 3, 7), 12, "h", nonce(req))

    def hold(self, req: str, blocks: tuple[int, ...]) -> None:
        """The producer holds ``blocks`` for ``req`` (under nonce(req))."""
        self.producer.hold(req, nonce(req), blocks, time.monotonic())

    def pump(
        self, until: Callable[[], bool], seconds: float = 5.0, finished: set[str] | None = None
    ) -> tuple[set[str], set[str], set[str]]:
        """Polls both workers until `until()` or `seconds`; returns (producer
        finished_sending, consumer finished_sending, consumer finished_recving)."""
        self.sent = sent = set[str]()
        self.released = released = set[str]()
        self.done = done = set[str]()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            released_now, done_now = self.consumer.poll(finished or set())
            released |= released_now
            done |= done_now
            sent |= self.producer.poll(set())[0]
            if until():
                break
            time.sleep(0.01)
        return sent, released, done

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()


def nonce(req: str) -> str:
    return hashlib.md5(req.encode()).hexdigest()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _block(caches: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.stack([c[:, block] for c in caches])


def test_descriptor_table_and_indices_address_every_layer_and_half() -> None:
    table = descriptor_table([1000, 5000], num_blocks=3, half_bytes=10)
    assert table.shape == (12, 3)
    # layer 1, V half, block 2: entry (1 * 2 + 1) * 3 + 2 = 11
    assert tuple(table[11]) == (5000 + 3 * 10 + 2 * 10, 10, 0)
    idx = descriptor_indices([2, 0], num_layers=2, num_blocks=3)
    assert idx.dtype == np.int32
    assert list(idx) == [2, 0, 5, 3, 8, 6, 11, 9]
    with pytest.raises(ValueError, match=r"out of range 0\.\.2"):
        descriptor_indices([3], num_layers=2, num_blocks=3)


def test_read_copies_the_blocks_and_frees_the_producer(pair: Pair) -> None:
    pair.hold("r1", (5, 3, 7))
    source = pair.source()
    pair.consumer.expect("r1", source)
    pair.consumer.receive(RecvSpec("r1", source, [0, 4], [5, 3]), time.monotonic())
    sent, released, done = pair.pump(lambda: bool(pair.done and pair.sent))
    assert done == {"r1"} and not released
    assert sent == {"r1"}, "the claim did not release the hold"
    # The claim names the whole list the params gave (it binds positions).
    assert pair.claims == [HoldClaim("r1", nonce("r1"), (5, 3, 7))]
    assert pair.consumer.take_invalid() == set()
    for local, remote in ((0, 5), (4, 3)):
        assert torch.equal(_block(pair.cons_caches, local), _block(pair.prod_caches, remote))
    assert pair.fetches == 1
    assert pair.consumer.take_stats() is None and pair.producer.take_stats() is None


def test_heartbeats_keep_a_hold_past_its_lease_until_the_consumer_rejects() -> None:
    pair = Pair(lease=0.3, timeout=30.0)
    try:
        pair.hold("r1", (5, 3, 7))
        pair.consumer.expect("r1", pair.source())
        sent, _, _ = pair.pump(lambda: False, seconds=1.2)
        assert sent == set() and "r1" in pair.producer.holds
        pair.consumer.end("r1")  # e.g. the request was aborted before its READ
        sent, _, _ = pair.pump(lambda: "r1" not in pair.producer.holds, seconds=2.0)
        assert sent == {"r1"}
    finally:
        pair.close()


def test_a_hold_lapses_without_heartbeats_and_at_the_transfer_timeout() -> None:
    pair = Pair(lease=0.2, timeout=0.6)
    try:
        now = time.monotonic()
        pair.hold("silent", (1,))
        pair.hold("beating", (2,))
        pair.consumer.expect("beating", pair.source("beating"))
        sent, _, _ = pair.pump(lambda: "silent" not in pair.producer.holds, seconds=2.0)
        lapsed = time.monotonic() - now
        assert sent == {"silent"} and 0.2 <= lapsed < 0.6
        sent, _, _ = pair.pump(lambda: not pair.producer.holds, seconds=2.0)
        assert sent == {"beating"} and time.monotonic() - now >= 0.6
        stats = pair.producer.take_stats()
        assert stats is not None and stats.leases_lapsed == 2 and not stats.failures
    finally:
        pair.close()


def test_a_reject_that_beats_its_hold_still_releases_it(pair: Pair) -> None:
    pair.consumer.expect("r1", pair.source())
    pair.pump(lambda: pair.consumer.slots[ADDRESS].peer is not None)
    pair.consumer.end("r1")  # sends reject:r1 before the producer holds r1
    pair.pump(lambda: pair.producer.ignored_notifs > 0 or bool(pair.producer.holds._early))
    pair.hold("r1", (5, 3, 7))
    sent, _, _ = pair.pump(lambda: not pair.producer.holds, seconds=2.0)
    assert sent == {"r1"}


def test_a_reject_or_heartbeat_under_another_nonce_is_ignored(pair: Pair) -> None:
    """Only the consumer the hold was offered to knows its nonce: params
    naming the request under any other nonce neither free nor keep it."""
    pair.hold("r1", (5, 3, 7))
    forged = replace(pair.source(), nonce="0" * 32)
    pair.consumer.expect("r1", forged)
    pair.pump(lambda: pair.consumer.slots[ADDRESS].peer is not None)
    pair.consumer.end("r1")  # reject under the forged nonce
    pair.pump(lambda: False, seconds=0.3)
    assert "r1" in pair.producer.holds


def test_unknown_notifications_are_counted_not_fatal(pair: Pair) -> None:
    pair.consumer.expect("ghost", pair.source("ghost"))
    pair.pump(lambda: pair.producer.ignored_notifs > 0, seconds=3.0)  # its heartbeat
    assert pair.producer.ignored_notifs >= 1 and not pair.producer.holds


def test_an_incompatible_peer_is_refused_and_the_blocks_recomputed(pair: Pair) -> None:
    pair.serve = lambda: replace(pair.info, compat={**COMPAT, "block_size": 32})
    source = pair.source()
    pair.hold("r1", (5, 3, 7))
    pair.consumer.receive(RecvSpec("r1", source, [0, 1], [5, 3]), time.monotonic())
    sent, released, done = pair.pump(lambda: not pair.producer.holds)
    assert done == {"r1"} and not released
    assert sent == {"r1"}, "the refused producer was not told to free its blocks"
    assert pair.consumer.take_invalid() == {0, 1}
    error = pair.consumer.slots[ADDRESS].error
    assert error is not None
    assert "incompatible KV cache: block_size: peer 32, here 4" in error.why
    stats = pair.consumer.take_stats()
    assert stats is not None and stats.failures == {TransferFailure.PEER_INCOMPATIBLE: 1}
    assert pair.producer.take_stats() is None  # released by the reject, not lapsed


def test_an_unreachable_peer_is_counted_as_such(pair: Pair) -> None:
    def down() -> PeerInfo:
        raise ConnectionError("connection refused")

    pair.serve = down
    pair.consumer.receive(RecvSpec("r1", pair.source(), [0], [5]), time.monotonic())
    _, _, done = pair.pump(lambda: "r1" not in pair.consumer.reads)
    assert done == {"r1"} and pair.consumer.take_invalid() == {0}
    stats = pair.consumer.take_stats()
    assert stats is not None and stats.failures == {TransferFailure.PEER_UNREACHABLE: 1}


def test_a_request_from_a_gone_incarnation_fails_after_one_refetch(pair: Pair) -> None:
    source = pair.source(agent="prod-before-restart")
    pair.consumer.receive(RecvSpec("r1", source, [2], [5]), time.monotonic())
    _, _, done = pair.pump(lambda: "r1" not in pair.consumer.reads)
    assert done == {"r1"} and pair.consumer.take_invalid() == {2}
    assert pair.fetches == 1  # fetched for it once, found another agent
    stats = pair.consumer.take_stats()
    assert stats is not None and stats.failures == {TransferFailure.PEER_RESTARTED: 1}
    # A request naming the current incarnation reads without a new handshake.
    good = pair.source("r2")
    pair.hold("r2", (5, 3, 7))
    pair.consumer.receive(RecvSpec("r2", good, [1], [7]), time.monotonic())
    _, _, done = pair.pump(lambda: "r2" not in pair.consumer.reads)
    assert done == {"r2"} and pair.consumer.take_invalid() == set()
    assert pair.fetches == 1


def test_a_request_finished_before_its_read_is_released_not_failed(pair: Pair) -> None:
    def slow() -> PeerInfo:
        time.sleep(0.3)
        return pair.info

    pair.serve = slow  # a slow handshake: the request finishes first
    source = pair.source()
    pair.consumer.receive(RecvSpec("r1", source, [0], [5]), time.monotonic())
    _, released, done = pair.pump(lambda: "r1" not in pair.consumer.reads, finished={"r1"})
    assert released == {"r1"} and not done
    assert pair.consumer.take_invalid() == set()
    assert pair.consumer.take_stats() is None  # nobody needed those blocks


def test_a_request_finished_mid_read_aborts_it_at_the_next_poll(pair: Pair) -> None:
    """A READ progresses only while the producer polls NIXL. A client that
    cancels makes the router release the producer's hold too, and an idle
    producer stops polling: the consumer must abort the READ, not wait for
    it (it used to wait out the whole transfer timeout, holding blocks)."""
    pair.hold("r1", (5, 3, 7))
    source = pair.source()
    pair.consumer.expect("r1", source)
    pair.consumer.receive(RecvSpec("r1", source, [0, 4], [5, 3]), time.monotonic())
    for _ in range(20):  # posts the READ; the producer never polls
        assert pair.consumer.poll(set()) == (set(), set())
        time.sleep(0.01)
    assert pair.consumer.reads["r1"].handle is not None, "the READ was not posted"
    pair.consumer.end("r1")
    released, done = pair.consumer.poll({"r1"})
    assert released == {"r1"} and not done
    assert "r1" not in pair.consumer.reads
    assert pair.consumer.take_invalid() == set() and pair.consumer.take_stats() is None
    sent, _, _ = pair.pump(lambda: not pair.producer.holds)
    assert sent == {"r1"}, "the producer was not told to free its blocks"


def test_handshake_facts_name_each_difference() -> None:
    ours = compat_facts("m", LAYOUT)
    theirs = {**ours, "block_size": 16, "dtype": "bfloat16"}
    assert incompatibility(ours, ours) is None
    assert incompatibility(ours, theirs) == (
        "block_size: peer 16, here 4; dtype: peer 'bfloat16', here 'float32'"
    )
    info = PeerInfo("a", b"\x00meta", 3, 64, (1, 2), ours)
    assert PeerInfo.from_bytes(info.to_bytes()) == info
    with pytest.raises(IncompatiblePeerError, match="malformed NIXL handshake"):
        PeerInfo.from_bytes(b'{"agent_name": "a"}')


def test_a_release_from_the_service_frees_a_hold_at_the_next_poll(pair: Pair) -> None:
    """The router says no decode pod will read (its decode leg was refused
    before any engine saw it): the hold ends without waiting for the lease."""
    pair.hold("r1", (1,))
    pair.hold("r2", (2,))
    pair.producer.release("r1")
    assert pair.producer.poll(set())[0] == {"r1"}
    assert "r1" not in pair.producer.holds and "r2" in pair.producer.holds


def _read_after(pair: Pair, end_hold: Callable[[], None]) -> tuple[set[str], set[int]]:
    """A READ of r1's held blocks whose hold ``end_hold`` ends before the
    claim: (consumer finished_recving, invalid block ids)."""
    pair.hold("r1", (5, 3, 7))
    end_hold()
    pair.producer.poll(set())  # the hold leaves; its blocks could be reused
    source = pair.source()
    pair.consumer.expect("r1", source)
    pair.consumer.receive(RecvSpec("r1", source, [0, 4], [5, 3]), time.monotonic())
    _, _, done = pair.pump(lambda: bool(pair.done))
    return done, pair.consumer.take_invalid()


def test_a_read_of_the_holds_tail_after_a_local_prefix_hit_is_confirmed(pair: Pair) -> None:
    pair.hold("r1", (5, 3, 7))
    source = pair.source()
    pair.consumer.expect("r1", source)
    pair.consumer.receive(RecvSpec("r1", source, [2], [7]), time.monotonic())
    _, _, done = pair.pump(lambda: bool(pair.done))
    assert done == {"r1"} and pair.consumer.take_invalid() == set()
    assert torch.equal(_block(pair.cons_caches, 2), _block(pair.prod_caches, 7))


def test_bytes_read_after_the_hold_was_released_are_never_used(pair: Pair) -> None:
    """The READ itself succeeds (NIXL cannot refuse it), but the claim finds
    the hold gone: the blocks are invalid and recomputed, counted."""
    done, invalid = _read_after(pair, lambda: pair.producer.release("r1"))
    assert done == {"r1"} and invalid == {0, 4}
    stats = pair.consumer.take_stats()
    assert stats is not None and stats.failures == {TransferFailure.HOLD_LOST: 1}


def test_bytes_read_after_the_lease_lapsed_are_never_used() -> None:
    pair = Pair(lease=0.05, timeout=30.0)
    try:
        done, invalid = _read_after(pair, lambda: time.sleep(0.1))
        assert done == {"r1"} and invalid == {0, 4}
        stats = pair.consumer.take_stats()
        assert stats is not None and stats.failures == {TransferFailure.HOLD_LOST: 1}
    finally:
        pair.close()


def test_a_claim_naming_other_blocks_is_refused_and_keeps_the_hold(pair: Pair) -> None:
    """Forged params (the right id and nonce, other blocks): the claim is
    refused, so the bytes are not used, and the real hold stays."""
    pair.hold("r1", (5, 3))
    source = pair.source()
    pair.consumer.expect("r1", source)
    pair.consumer.receive(RecvSpec("r1", source, [0], [7]), time.monotonic())
    _, _, done = pair.pump(lambda: bool(pair.done))
    assert done == {"r1"} and pair.consumer.take_invalid() == {0}
    pair.hold("r2", (4, 6))
    forgeries = [(6,), (6, 4), (4, 6, 7)]  # a part, reordered (positions swapped), more
    for blocks in forgeries:
        assert pair.producer.claim(HoldClaim("r2", nonce("r2"), blocks).to_bytes()) is Claim.GONE
    assert pair.producer.claim(HoldClaim("r2", nonce("r1"), (4, 6)).to_bytes()) is Claim.GONE
    assert "r2" in pair.producer.holds
    assert pair.producer.claim(HoldClaim("r2", nonce("r2"), (4, 6)).to_bytes()) is Claim.HELD
    assert pair.producer.claim(HoldClaim("r2", nonce("r2"), (4, 6)).to_bytes()) is Claim.GONE
    assert pair.producer.claim(HoldClaim("r9", nonce("r9"), (1,)).to_bytes()) is Claim.UNKNOWN
    with pytest.raises(ValueError, match="malformed hold claim"):
        pair.producer.claim(b'{"request_id": "r1"}')
