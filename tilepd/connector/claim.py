"""The connector's claim decision on the tilepd marker (tilepd.contracts.marker) in vLLM's `kv_transfer_params`.

Only the router (and the deploy canary) sets the marker (INTERFACES §3).

A request without the key is none of the connector's business (strict no-op, so
other connectors under MultiConnector see it untouched). A request with a bad
marker, a decode node outside the allowlist, a prompt longer than the decode
node's max_seq_len, or a node whose fingerprint (as the router sends it beside the
marker) names another checkpoint than this prefill serves is *refused*: vLLM still
serves it, nothing is sent, and the router reads why (`tilepd_handoff`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tilepd.contracts.fingerprint import Fingerprint, compare
from tilepd.contracts.marker import FINGERPRINT_REFUSAL, MARKER_KEY, NODE_FINGERPRINT_KEY, TilepdMarker
from tilepd.contracts.service_configs import ConnectorExtraConfig
from tilepd.runbooks import cite


@dataclass(frozen=True)
class ClaimDecision:
    marker: TilepdMarker | None  # set when claimed
    refused: str | None = None  # reason when refused
    transfer_id: str | None = None


def decide_claim(kv_transfer_params: Any, num_prompt_tokens: int, config: ConnectorExtraConfig,
                 fingerprint: Fingerprint | None = None) -> ClaimDecision | None:
    """None: not ours (no marker). Otherwise claimed (marker set) or refused (reason set). `fingerprint`: this
    prefill's, compared with the node's when the router sent it."""
    if not isinstance(kv_transfer_params, dict) or MARKER_KEY not in kv_transfer_params:
        return None
    raw = kv_transfer_params[MARKER_KEY]
    tid = raw.get("transfer_id") if isinstance(raw, dict) else None
    tid = tid if isinstance(tid, str) else None
    try:
        marker = TilepdMarker.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
        return ClaimDecision(None, f"bad marker at tilepd.{where}: {first['msg']}", tid)
    allowed = {(e.host, e.ctrl_port) for e in config.decode_allowlist}
    if (marker.host, marker.ctrl_port) not in allowed:
        names = ", ".join(f"{h}:{p}" for h, p in sorted(allowed)) or "none"
        return ClaimDecision(
            None, f"decode node {marker.host}:{marker.ctrl_port} is not in the allowlist ({names})", marker.transfer_id
        )
    if num_prompt_tokens > config.max_seq_len:
        return ClaimDecision(
            None, f"prompt of {num_prompt_tokens} tokens exceeds max_seq_len {config.max_seq_len}", marker.transfer_id
        )
    problem = _fingerprint_problem(kv_transfer_params.get(NODE_FINGERPRINT_KEY), fingerprint, marker, config)
    if problem is not None:
        return ClaimDecision(None, FINGERPRINT_REFUSAL + cite(problem, "RB-fingerprint-mismatch"), marker.transfer_id)
    return ClaimDecision(marker, None, marker.transfer_id)


def _fingerprint_problem(raw: Any, own: Fingerprint | None, marker: TilepdMarker, config: ConnectorExtraConfig) -> str | None:
    """Why the node the router named holds another checkpoint, or None (nothing sent: the node's hello decides)."""
    if raw is None or own is None:
        return None
    try:
        node = Fingerprint.model_validate(raw)
    except ValidationError:
        return None  # a router of another release: the node's own check at the hello still holds
    name = next((e.name for e in config.decode_allowlist if (e.host, e.ctrl_port) == (marker.host, marker.ctrl_port)), marker.host)
    return compare(own, node, name)
