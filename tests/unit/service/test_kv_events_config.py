"""The publisher's settings: addresses checked with the flag named, vLLM's
bind-or-connect rule, and the engine must record events."""

from __future__ import annotations

import logging

import pytest

from engine.config import CacheConfig, ConfigError, EngineConfig
from service.kv_events_config import KvEventsConfig, binds, recording_events


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://*:5557", "tcp://127.0.0.1:5557", "tcp://[::]:5557", "tcp://indexer.ns.svc:5557",
     "tcp://127.0.0.1:*", "ipc:///tmp/kv-events", "inproc://kv"],
)  # fmt: skip
def test_good_endpoints(endpoint: str) -> None:
    assert KvEventsConfig(endpoint, replay_endpoint=endpoint).endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    ["5557", "tcp://*", "tcp://:5557", "tcp://*:0", "tcp://*:70000", "udp://*:5557",
     "ipc://", "http://host:5557", "tcp://host:port"],
)  # fmt: skip
def test_bad_endpoint_names_the_flag(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"^--kv-events-endpoint: .* is not a ZMQ endpoint"):
        KvEventsConfig(endpoint)


def test_bad_replay_endpoint_names_its_flag() -> None:
    with pytest.raises(ConfigError, match=r"^--kv-events-replay-endpoint: 'tcp://\*'"):
        KvEventsConfig("tcp://*:5557", replay_endpoint="tcp://*")


def test_buffer_steps_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--kv-events-buffer-steps: must be >= 1, got 0"):
        KvEventsConfig("tcp://*:5557", buffer_steps=0)


def test_vllm_defaults() -> None:
    config = KvEventsConfig("tcp://*:5557")
    assert (config.replay_endpoint, config.topic) == (None, "")
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (10_000, 100_000, 100_000)


@pytest.mark.parametrize(
    ("endpoint", "bound"),
    [("tcp://*:5557", True), ("tcp://[::]:5557", True), ("ipc:///tmp/x", True),
     ("inproc://x", True), ("tcp://127.0.0.1:5557", False), ("tcp://indexer:5557", False)],
)  # fmt: skip
def test_bind_or_connect_is_vllms_rule(endpoint: str, bound: bool) -> None:
    assert binds(endpoint) is bound


def test_the_publisher_turns_the_engines_events_on() -> None:
    config = recording_events(EngineConfig(cache=CacheConfig(enable_kv_events=False)))
    assert config.cache.enable_kv_events


def test_prefix_caching_off_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        recording_events(EngineConfig(cache=CacheConfig(enable_prefix_caching=False)))
    assert "prefix caching off" in caplog.text
