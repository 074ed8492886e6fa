"""Waiting queues: FCFS (a deque) and priority (a heap).

Both keep vLLM's exact semantics, including the order in which a batch of
skipped requests is put back at the head, because scheduling decisions are
compared step by step with vLLM's.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from engine.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(Protocol):
    """What the scheduler needs of a waiting queue."""

    def add_request(self, request: Request) -> None: ...
    def pop_request(self) -> Request: ...
    def peek_request(self) -> Request: ...
    def prepend_request(self, request: Request) -> None: ...
    def prepend_requests(self, requests: RequestQueue) -> None: ...
    def remove_request(self, request: Request) -> None: ...
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    def __bool__(self) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def unordered(self) -> Iterable[Request]:
        """Every request, in no particular order (cheaper than iterating);
        the caller must not change the queue while it reads."""
        ...


class FCFSRequestQueue(deque[Request]):
    """Arrival order; preempted and skipped requests go back to the front."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        self.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def __bool__(self) -> bool:
        return len(self) > 0

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(requests)
        kept = [r for r in self if r not in drop]
        self.clear()
        self.extend(kept)

    def unordered(self) -> Iterable[Request]:
        return self


class PriorityRequestQueue:
    """Lowest (priority, arrival_time) first; "prepend" is just an insert."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = requests if isinstance(requests, set) else set(requests)
        self._heap = [r for r in self._heap if r not in drop]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def unordered(self) -> Iterable[Request]:
        return self._heap  # heap order: no sorted copy

    def __iter__(self) -> Iterator[Request]:
        """In priority order (a sorted copy; the heap is not disturbed)."""
        heap = self._heap[:]
        while heap:
            yield heapq.heappop(heap)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
