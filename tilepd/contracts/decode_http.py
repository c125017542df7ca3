"""The decode node's HTTP request bodies (INTERFACES §4): the node validates them (tilepd.runtime.http_api), the router
and the canary build them, so a parameter added here is one edit and a typo on the sending side fails where it is made."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# The node's HTTP API version (INTERFACES §4). 2: a router reserves the slot on the node (`/v1/reserve`, a lease it
# renews, a fence every later call names) before the prefill; a decode without a fence (a router of API 1) is refused.
NODE_API_VERSION = 2

class _Body(BaseModel):
    def as_json(self) -> dict[str, Any]:
        """What goes on the wire: the fields the sender set (the node fills in its own defaults)."""
        return self.model_dump(mode="json", exclude_unset=True)


class StructuredOutputBody(_Body):
    """A decoding constraint (tilepd.engine.grammar): json_schema / regex / grammar text in `spec`."""

    model_config = ConfigDict(extra="forbid")
    type: str = Field(min_length=1, max_length=32)
    spec: str = Field(default="", max_length=1 << 20)


class ReserveBody(_Body):
    """A router's claim on the node's one slot, made before the prefill (node API 2): the node answers the fence and
    the lease the router renews, or `busy` naming who holds it."""

    model_config = ConfigDict(extra="forbid")
    transfer_id: str = Field(min_length=1, max_length=200)
    token: str = Field(min_length=1, max_length=200)
    holder: str = Field(min_length=1, max_length=200)  # the router's identity, told to another router that finds the slot held
    node_api: int = Field(ge=1)  # the caller's node API version: another than the node's is refused with what to upgrade


class RenewBody(_Body):
    """Extends the reservation's lease by the node's lease length; a fence that no longer holds the slot is refused."""

    model_config = ConfigDict(extra="forbid")
    transfer_id: str = Field(min_length=1, max_length=200)
    fence: int = Field(ge=0)


class DecodeBody(_Body):
    model_config = ConfigDict(extra="forbid")

    transfer_id: str = Field(min_length=1, max_length=200)
    token: str = Field(min_length=1, max_length=200)
    # the reservation's fencing generation (from /v1/reserve); None: a router of node API 1, refused with a message
    fence: int | None = Field(default=None, ge=0)
    first_token: int = Field(ge=0)
    prompt_tokens: int = Field(gt=0)
    max_tokens: int = Field(default=16, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = True
    kv_timeout_s: float | None = Field(default=None, gt=0, le=3600)
    # logprobs: True or n >= 0 -> each token's logprob and its top n (top_logprobs, when set, is n);
    # a 501 when the engine does not declare them (capabilities: logprobs, top_logprobs_max)
    logprobs: int | bool | None = Field(default=None, ge=0)
    top_logprobs: int | None = Field(default=None, ge=0)
    # the constraint the prefill sampled first_token under; the node's matcher starts after first_token
    structured_output: StructuredOutputBody | None = None
    # accepted so a request that sets them gets 501 (not 400) when the engine cannot honour them
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0


class CancelBody(_Body):
    model_config = ConfigDict(extra="forbid")
    transfer_id: str
    # with a fence, only the reservation that carries it is cancelled (a stale caller cannot end its successor's)
    fence: int | None = Field(default=None, ge=0)


class DrainBody(_Body):
    """Why a node is drained (optional): shown by its /health, /status and `tilepd status` until it is undrained. The
    router's divergence watch (tilepd.router.divergence_watch) drains a node whose tokens left the prefill's."""

    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(default=None, max_length=500)
