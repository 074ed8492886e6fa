"""A shared real server (default model, loopback port) for the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.servers import ServerProcess


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One `tandem serve` for the session, with metrics on. Tests must leave
    it idle (no request left running) when they finish. 64 running at most:
    part of test_load's 200 concurrent calls has to wait."""
    with ServerProcess(["--max-num-seqs", "64"], metrics=True) as srv:
        yield srv
