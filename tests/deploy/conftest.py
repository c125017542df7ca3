"""Fixtures for deploy tests: SSH test hosts in network namespaces."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.netns import LabNetwork, missing_prerequisites


@pytest.fixture(scope="session")
def lab_network(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabNetwork]:
    """Three SSH hosts (10.77.0.11/.12/.13) in network namespaces, torn down at session end."""
    why = missing_prerequisites()
    if why:
        pytest.skip(f"SSH test hosts unavailable: {why}")
    net = LabNetwork(root=tmp_path_factory.mktemp("lab"))
    try:
        net.start()
        yield net
    finally:
        net.stop()
