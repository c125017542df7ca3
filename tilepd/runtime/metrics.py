"""Prometheus metrics of one decode node (its own registry, served at /metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from tilepd.runtime.slot import Slot

_MS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120)


class _SlotCollector:
    def __init__(self, slot: "Slot", bad_frames: "callable"):
        self.slot, self.bad_frames = slot, bad_frames

    def collect(self) -> Iterator:
        yield CounterMetricFamily("tilepd_decode_transfers", "KV transfers completed into the receive buffer", value=self.slot.transfers_total)
        yield CounterMetricFamily("tilepd_decode_transfer_bytes", "KV bytes received by completed transfers", value=self.slot.bytes_total)
        yield CounterMetricFamily("tilepd_decode_ctrl_bad_frames", "control frames refused (connection closed)", value=self.bad_frames())
        yield GaugeMetricFamily("tilepd_decode_busy", "1 while a live reservation holds the slot (a lapsed one counts free)", value=1.0 if self.slot.busy else 0.0)
        yield CounterMetricFamily("tilepd_decode_reservations_expired", "router reservations whose lease ran out (the router died or "
                                  "was cut off): the slot was taken back", value=self.slot.reservations_expired)


class DecodeMetrics:
    def __init__(self, slot: "Slot", bad_frames: "callable"):
        self.registry = CollectorRegistry()
        self.registry.register(_SlotCollector(slot, bad_frames))
        r = self.registry
        self.requests = Counter("tilepd_decode_requests", "decode requests by outcome", ["outcome"], registry=r)
        self.wait = Histogram("tilepd_decode_kv_wait_seconds", "decode request arrival to KV complete", buckets=_MS_BUCKETS, registry=r)
        self.convert = Histogram("tilepd_decode_convert_seconds", "received bytes to engine layout", buckets=_MS_BUCKETS, registry=r)
        self.inject = Histogram("tilepd_decode_inject_seconds", "engine.inject", buckets=_MS_BUCKETS, registry=r)
        self.decode = Histogram("tilepd_decode_decode_seconds", "engine.decode", buckets=_MS_BUCKETS, registry=r)
        self.tokens = Counter("tilepd_decode_tokens", "tokens generated", registry=r)
        self.loop_lag = Histogram("tilepd_decode_loop_lag_seconds", "how late the node's event loop woke for a 0.5 s tick "
                                  "(seconds of not answering; a stall over 2 s is logged as event=loop_stall)",
                                  buckets=_MS_BUCKETS, registry=r)
        self.tokens_per_s = Gauge("tilepd_decode_tokens_per_second", "tokens/s of the last decode", registry=r)
