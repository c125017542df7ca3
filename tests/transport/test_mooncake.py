"""Mooncake transport: two processes over its TCP protocol where the library loads (GPU hosts with the
driver); elsewhere the test is skipped with the loader's own reason, and the refusal message is checked."""

from __future__ import annotations

import pytest

from tilepd.transport import TransportUnavailable
from tilepd.transport.mooncake_transport import load_engine_class


def _unavailable_reason() -> str | None:
    try:
        load_engine_class()
    except TransportUnavailable as exc:
        return str(exc)
    return None


REASON = _unavailable_reason()


def test_unavailable_message_says_what_to_do() -> None:
    if REASON is None:
        pytest.skip("mooncake loads here; the refusal path is not reachable")
    assert "mooncake" in REASON and ("nixl" in REASON and "tcp" in REASON)


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"mooncake cannot load on this host: {REASON}")
def test_mooncake_two_process_write_checksums() -> None:
    from tilepd.transport.bench import raw_bandwidth

    r = raw_bandwidth("mooncake", 64 << 20, repeats=2, protocol="tcp")
    assert r["checksum_ok"], r
