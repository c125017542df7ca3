"""What a router does on a decode node before its decode request (node API 2), for tests that drive a node by hand:
reserve the slot, then name the reservation's fence."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import httpx

from tilepd.contracts.decode_http import NODE_API_VERSION
from tilepd.runtime.slot import Slot, Transfer


def reserve_and_attach(slot: Slot, transfer_id: str, token: str, holder: str = "test") -> Transfer:
    """In process: the reservation, then its decode request joins it."""
    tr = slot.reserve(transfer_id, token, holder)
    assert tr.reservation is not None
    return slot.attach_decode(transfer_id, token, tr.reservation.fence)


def reserve_http(client: httpx.Client | str, transfer_id: str, token: str, headers: dict[str, str] | None = None,
                 holder: str = "test") -> int:
    """Over HTTP (a client with the node's base_url, or the base URL): the reservation's fence; raises on a refusal."""
    body: dict[str, Any] = {"transfer_id": transfer_id, "token": token, "holder": holder, "node_api": NODE_API_VERSION}
    if isinstance(client, str):
        r = httpx.post(client.rstrip("/") + "/v1/reserve", json=body, headers=headers, timeout=30)
    else:
        r = client.post("/v1/reserve", json=body, headers=headers)
    assert r.status_code == 200, f"/v1/reserve answered {r.status_code}: {r.text}"
    return int(r.json()["fence"])


def reserved_body(client: httpx.Client | str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    """A /v1/decode body with the fence of a fresh reservation of its transfer id."""
    return {**body, "fence": reserve_http(client, body["transfer_id"], body["token"], headers)}


@contextmanager
def renewing(base_url: str, transfer_id: str, fence: int, lease_s: float) -> Iterator[None]:
    """A living holder, as a router is while its request lives: renew the lease every quarter of it until the block
    ends (a renewal the node refuses, because the reservation ended, is what a router would stop on: it is ignored)."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lease_s / 4):
            try:
                httpx.post(base_url.rstrip("/") + "/v1/renew", json={"transfer_id": transfer_id, "fence": fence}, timeout=5)
            except httpx.HTTPError:
                pass  # the node is busy answering; the next renewal is due within a quarter lease

    renewer = threading.Thread(target=renew, name=f"renew-{transfer_id}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join(10)
