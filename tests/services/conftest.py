"""Fixtures for the service tests: a real redis-server on a free loopback port (started here,
stopped at the end) and tiny seeded models."""

from __future__ import annotations

import pytest

from specdec.testing import perturbed_copy, tiny_llama
from specdec.app.launcher import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def long_target():
    """A tiny target without an EOS token: generations run to max_tokens (long sessions)."""
    return tiny_llama(seed=0, vocab_size=96, num_layers=2, hidden_size=48, eos_token_id=None)


@pytest.fixture(scope="session")
def good_draft(long_target):
    """A draft that agrees with the target most of the time (long accepted blocks, pipeline hits)."""
    return perturbed_copy(long_target, noise=0.05, seed=3)


@pytest.fixture(scope="session")
def weak_draft(long_target):
    return perturbed_copy(long_target, noise=0.25, seed=1)
