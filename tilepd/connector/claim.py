"""The connector's claim decision on the tilepd marker (tilepd.contracts.marker) in vLLM's `kv_transfer_params`.

Only the router (and the deploy canary) sets the marker (INTERFACES §3).

A request without the key is none of the connector's business (strict no-op, so
other connectors under MultiConnector see it untouched). A request with a bad
marker, a decode node outside the allowlist, or a prompt longer than the decode
node's max_seq_len is *refused*: vLLM still serves it, nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tilepd.contracts.marker import MARKER_KEY, TilepdMarker
from tilepd.contracts.service_configs import ConnectorExtraConfig


@dataclass(frozen=True)
class ClaimDecision:
    marker: TilepdMarker | None  # set when claimed
    refused: str | None = None  # reason when refused
    transfer_id: str | None = None


def decide_claim(kv_transfer_params: Any, num_prompt_tokens: int, config: ConnectorExtraConfig) -> ClaimDecision | None:
    """None: not ours (no marker). Otherwise claimed (marker set) or refused (reason set)."""
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
    return ClaimDecision(marker, None, marker.transfer_id)
