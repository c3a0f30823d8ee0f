"""Executor tests: gloo between ranks on the loopback interface only."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def gloo_on_loopback():
    """Spawned ranks inherit the environment: their gloo pairs listen on 127.0.0.1."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLOO_SOCKET_IFNAME", "lo")
        yield
