"""Compatibility checks both ends run on hello, with messages that say what to change."""

from __future__ import annotations

from typing import Any

from tilepd import __version__
from tilepd.contracts.fingerprint import Fingerprint, compare
from tilepd.control.cache_layout import LAYOUT_VERSION
from tilepd.control.messages import MIN_TILEPD_FOR_PROTOCOL, PROTOCOL_VERSION, ErrorCode, Hello, HelloOk, ProtocolError
from tilepd.runbooks import see

_HOSTS = {"decode node": "the decode node", "prefill connector": "the prefill hosts (the vLLM connector)"}


def _upgrade_hint(local: int, remote: int, local_side: str, remote_side: str) -> str:
    older = local_side if local < remote else remote_side
    if max(local, remote) == PROTOCOL_VERSION:
        newer = remote_side if older == local_side else local_side
        return (f"upgrade {_HOSTS.get(older, older)} to tilepd >= {MIN_TILEPD_FOR_PROTOCOL} with control protocol {PROTOCOL_VERSION} "
                f"(the release the {newer} runs), so both ends speak protocol {PROTOCOL_VERSION}")
    return f"upgrade tilepd on the {older} so both ends run the same tilepd release"


def check_raw_hello(obj: dict[str, Any]) -> None:
    """Decode-node side, before the hello is parsed: a peer of another protocol version may send fields this
    version does not know (or lack ones it needs), so its version is checked on the raw frame first."""
    if obj.get("type") != "hello":
        return
    proto = obj.get("protocol")
    if isinstance(proto, int) and not isinstance(proto, bool) and proto != PROTOCOL_VERSION:
        rv = obj.get("tilepd_version")
        check_protocol(proto, local_side="decode node", remote_side="prefill connector", remote_version=rv if isinstance(rv, str) else None)


def check_protocol(remote: int, *, local_side: str, remote_side: str, remote_version: str | None = None) -> None:
    if remote != PROTOCOL_VERSION:
        rv = f" (tilepd {remote_version})" if remote_version else ""
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"the {remote_side}{rv} speaks control protocol {remote}, the {local_side} (tilepd {__version__}) speaks "
            f"{PROTOCOL_VERSION}: {_upgrade_hint(PROTOCOL_VERSION, remote, local_side, remote_side)}" + see("RB-protocol-mismatch"),
        )


def check_fingerprint(prefill: Fingerprint | None, node: Fingerprint | None, node_name: str = "") -> None:
    """Both sides: the prefill must serve the checkpoint the decode node's weights were converted from (a node that
    reports no fingerprint, an in-process test node, is not compared)."""
    problem = compare(prefill, node, node_name)
    if problem is not None:
        raise ProtocolError(ErrorCode.FINGERPRINT_MISMATCH, problem + see("RB-fingerprint-mismatch"))


def check_hello(hello: Hello, *, transport: str, max_seq_len: int | None = None) -> None:
    """Decode-node side: protocol, layout version and transport must match this node. The node checks the cache layout
    next, then the fingerprint (`check_fingerprint`): a prefill whose cache another node reads differs in checkpoint
    too, and the layout's message names what to fix where two hashes would not."""
    check_protocol(hello.protocol, local_side="decode node", remote_side="prefill connector", remote_version=hello.tilepd_version)
    if hello.layout.layout_version != LAYOUT_VERSION:
        raise ProtocolError(
            ErrorCode.LAYOUT_MISMATCH,
            f"the prefill connector sends cache layout version {hello.layout.layout_version}, this decode node reads "
            f"version {LAYOUT_VERSION}: {_upgrade_hint(LAYOUT_VERSION, hello.layout.layout_version, 'decode node', 'prefill connector')}"
            + see("RB-protocol-mismatch"),
        )
    if hello.transport.name != transport:
        raise ProtocolError(
            ErrorCode.TRANSPORT_MISMATCH,
            f"the prefill connector sends over transport {hello.transport.name!r} but this decode node receives over "
            f"{transport!r}: set the same transport name for the prefill hosts' connector "
            f"(kv_connector_extra_config.transport.name) and the decode node (its config's transport.name)" + see("RB-protocol-mismatch"),
        )
    # max_seq_len is not compared here: decode nodes of one model may hold fewer tokens than the
    # connector allows; an admit whose seq_len does not fit is refused with too_long instead.


def check_hello_ok(reply: HelloOk, *, transport: str, fingerprint: Fingerprint | None = None) -> None:
    """Connector side: the decode node must speak our protocol over our transport and hold our checkpoint (a node
    checks that itself first; this is the check of a node that did not)."""
    check_protocol(reply.protocol, local_side="prefill connector", remote_side="decode node")
    if reply.transport.name != transport:
        raise ProtocolError(
            ErrorCode.TRANSPORT_MISMATCH,
            f"the decode node receives over {reply.transport.name!r} but this connector sends over {transport!r}: "
            "set the same transport name for the connector and the decode node" + see("RB-protocol-mismatch"),
        )
    if fingerprint is not None:
        check_fingerprint(fingerprint, reply.fingerprint, reply.node)
