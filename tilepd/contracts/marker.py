"""The tilepd marker in vLLM's `kv_transfer_params` (INTERFACES §3): set by the router and the canary, read by the connector.

    {"tilepd": {"host": "10.0.0.5", "ctrl_port": 5556, "transfer_id": "tx-...", "token": "<hex>"}}

What the connector decides about a marker (claim or refuse) is its own business: tilepd.connector.claim.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MARKER_KEY = "tilepd"
# the key under which request_finished reports the hand-off (no clash with NixlConnector's keys)
RESULT_KEY = "tilepd_handoff"


class TilepdMarker(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(min_length=1, max_length=255)
    ctrl_port: int = Field(gt=0, lt=65536)
    transfer_id: str = Field(min_length=1, max_length=200)
    token: str = Field(min_length=1, max_length=200)

    def as_params(self) -> dict[str, Any]:
        """The marker as it goes into a request's `kv_transfer_params`."""
        return {MARKER_KEY: self.model_dump()}


def handoff_result(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The connector's `tilepd_handoff` report from one vLLM response object, None when it carries none.

    `body` is a non-streamed completion's JSON (every supported vLLM) or one chunk of a streamed one: vLLM >= 0.33
    puts `kv_transfer_params` on the chunk whose choice has its finish_reason (completion/serving.py,
    chat_completion/serving.py); the other chunks, and a trailing usage chunk, have none. vLLM 0.31-0.32 streams
    never carry it: stream a prefill only where the report may be missing.
    """
    params = body.get("kv_transfer_params")
    result = params.get(RESULT_KEY) if isinstance(params, Mapping) else None
    return dict(result) if isinstance(result, Mapping) else None


def handoff_result_of_stream(chunks: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """`handoff_result` over a streamed response's decoded SSE chunks: the first chunk that carries it."""
    for chunk in chunks:
        found = handoff_result(chunk)
        if found is not None:
            return found
    return None
