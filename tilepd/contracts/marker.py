"""The tilepd marker in vLLM's `kv_transfer_params` (INTERFACES §3): set by the router and the canary, read by the connector.

    {"tilepd": {"host": "10.0.0.5", "ctrl_port": 5556, "transfer_id": "tx-...", "token": "<hex>"}}

What the connector decides about a marker (claim or refuse) is its own business: tilepd.connector.claim.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MARKER_KEY = "tilepd"
# the key under which request_finished reports the hand-off (no clash with NixlConnector's keys)
RESULT_KEY = "tilepd_handoff"
# beside the marker (an older connector ignores it): the decode node's fingerprint as the router last read it
# (its /capabilities); the connector refuses the claim when it names another checkpoint than the prefill serves
NODE_FINGERPRINT_KEY = "tilepd_node_fingerprint"
# how the reason of a claim refused for that starts (the router's route reason is `fingerprint_mismatch`)
FINGERPRINT_REFUSAL = "fingerprint_mismatch: "


class TilepdMarker(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(min_length=1, max_length=255)
    ctrl_port: int = Field(gt=0, lt=65536)
    transfer_id: str = Field(min_length=1, max_length=200)
    token: str = Field(min_length=1, max_length=200)

    def as_params(self) -> dict[str, Any]:
        """The marker as it goes into a request's `kv_transfer_params`."""
        return {MARKER_KEY: self.model_dump()}
