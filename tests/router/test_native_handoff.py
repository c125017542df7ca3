"""The native pool really hands off on CPU (issue 13 part 8): a native request's KV is pulled over NIXL
well inside the prefill's block lease (30 s), no lease expires, and the text equals vLLM alone.

Measured on vLLM's own /metrics: the native decode's `vllm:nixl_xfer_time_seconds` (one entry per
KV read) and the prefill's `vllm:nixl_num_kv_expired_reqs` / `vllm:nixl_num_notifications_after_expiry`
(a read after the lease: "Potentially invalid KV blocks"). Before the two instances had disjoint
cores, such a request took 7-134 s and its read came after the lease had expired.
"""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest

from .conftest import Stack
from .stack import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LEASE_S = 30.0  # vLLM's default kv_lease_duration


def _nixl(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"vllm:(nixl_\w+?)(?:_total)?(?:\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_native_request_pulls_its_kv_well_under_the_lease(native_router: tuple[str, Any], router_stack: Stack) -> None:
    url, _ = native_router
    assert router_stack.prefill is not None and router_stack.native is not None
    body = {"prompt": "Once upon a time, in a land far away, there lived", "max_tokens": 4, "temperature": 0}
    alone = httpx.post(router_stack.prefill.url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=120).json()
    d0, p0 = _nixl(router_stack.native.url), _nixl(router_stack.prefill.url)
    t = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"model": f"{MODEL_NAME}-native", **body}, timeout=120)
    took = time.monotonic() - t
    assert r.status_code == 200, r.text
    assert r.headers["x-tilepd-route"] == "native"
    d1, p1 = _nixl(router_stack.native.url), _nixl(router_stack.prefill.url)
    reads = d1.get("nixl_xfer_time_seconds_count", 0) - d0.get("nixl_xfer_time_seconds_count", 0)
    read_s = d1.get("nixl_xfer_time_seconds_sum", 0) - d0.get("nixl_xfer_time_seconds_sum", 0)
    assert reads >= 1, f"the native decode read no KV over NIXL (recomputed?): {d1}"
    assert d1.get("nixl_num_failed_transfers", 0) == d0.get("nixl_num_failed_transfers", 0), d1
    assert p1.get("nixl_num_kv_expired_reqs", 0) == p0.get("nixl_num_kv_expired_reqs", 0), f"a prefill lease expired: {p1}"
    assert p1.get("nixl_num_notifications_after_expiry", 0) == p0.get("nixl_num_notifications_after_expiry", 0), p1
    assert read_s < 1.0, read_s
    assert took < LEASE_S / 3, f"native request took {took:.1f} s"
    assert r.json()["choices"][0]["text"] == alone["choices"][0]["text"]
