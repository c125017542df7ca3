"""SSH test hosts for the doctor: the deploy tests' network-namespace lab (tests/deploy/netns.py), reused by
import, on its own subnet (10.77.1.0/24) so it can live next to the deploy tests' lab in one session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.netns import LabNetwork, missing_prerequisites

ADDRESSES = ("10.77.1.11", "10.77.1.12", "10.77.1.13")  # decode, prefill, router (as lab-3host.yaml's .11/.12/.13)


@pytest.fixture(scope="module")
def doctor_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabNetwork]:
    why = missing_prerequisites()
    if why:
        pytest.skip(f"SSH test hosts unavailable: {why}")
    net = LabNetwork(root=tmp_path_factory.mktemp("doctor-lab"), addresses=ADDRESSES, gateway="10.77.1.1")
    try:
        net.start()
        yield net
    finally:
        net.stop()
