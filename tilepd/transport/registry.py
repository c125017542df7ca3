"""Build a transport's sender or receiver from a `TransportConfig`.

Implementations whose libraries may be missing (nixl, mooncake) are imported only
here, on demand, so `tcp` works on a machine that has neither.
"""

from __future__ import annotations

from typing import Sequence

from tilepd.contracts.service_configs import TransportConfig
from tilepd.transport.base import TransportReceiver, TransportSender


def make_sender(config: TransportConfig, *, name: str = "tilepd-sender", connect_timeout_s: float = 5.0) -> TransportSender:
    if config.name == "tcp":
        from tilepd.transport.tcp import TcpSender

        return TcpSender(connect_timeout_s=connect_timeout_s)
    if config.name == "nixl":
        from tilepd.transport.nixl_transport import NixlSender

        return NixlSender(name=name, ucx_net_devices=config.ucx_net_devices)
    if config.name == "mooncake":
        from tilepd.transport.mooncake_transport import MooncakeSender

        return MooncakeSender(protocol=config.mooncake_protocol, devices=config.mooncake_devices)
    raise ValueError(f"unknown transport {config.name!r}")


def make_receiver(
    config: TransportConfig,
    *,
    bind_host: str,
    advertise_host: str,
    allowed_senders: Sequence[str] = (),
    name: str = "tilepd-receiver",
) -> TransportReceiver:
    if config.name == "tcp":
        from tilepd.transport.tcp import TcpReceiver

        return TcpReceiver(bind_host, config.data_port or 0, advertise_host, allowed_senders)
    if config.name == "nixl":
        from tilepd.transport.nixl_transport import NixlReceiver

        return NixlReceiver(name=name, ucx_net_devices=config.ucx_net_devices)
    if config.name == "mooncake":
        from tilepd.transport.mooncake_transport import MooncakeReceiver

        return MooncakeReceiver(advertise_host=advertise_host, protocol=config.mooncake_protocol, devices=config.mooncake_devices)
    raise ValueError(f"unknown transport {config.name!r}")
