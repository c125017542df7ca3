"""Control-protocol messages (INTERFACES §3) as pydantic models.

Every frame carries a `type`; `parse_message` turns a decoded frame into its model
and raises `ProtocolError` (code `malformed`) for anything else, so a peer's bad
input is always a typed, closable error.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tilepd.control.cache_layout import CacheLayout

PROTOCOL_VERSION = 2
# The oldest tilepd release that speaks PROTOCOL_VERSION (named in "upgrade ..." messages).
MIN_TILEPD_FOR_PROTOCOL = "0.2.0"


class ErrorCode(str, Enum):
    VERSION_MISMATCH = "version_mismatch"
    LAYOUT_MISMATCH = "layout_mismatch"
    TRANSPORT_MISMATCH = "transport_mismatch"
    TOO_LONG = "too_long"
    BAD_TOKEN = "bad_token"
    BUSY = "busy"  # the only retryable code
    UNKNOWN_TRANSFER = "unknown_transfer"
    NOT_ALLOWED = "not_allowed"  # sender address not in the decode node's allowed_senders
    MALFORMED = "malformed"  # frame or message did not parse
    NOT_READY = "not_ready"  # admit before a successful hello
    KV_CHECKSUM_MISMATCH = "kv_checksum_mismatch"  # the bytes that landed are not the bytes the sender staged


RETRYABLE = frozenset({ErrorCode.BUSY})


class ProtocolError(Exception):
    """A refusal with a code and a message that says what to change."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TransportInfo(_Msg):
    name: Literal["tcp", "nixl", "mooncake"]
    metadata: dict[str, Any] = Field(default_factory=dict)


class Hello(_Msg):
    type: Literal["hello"] = "hello"
    protocol: int
    layout: CacheLayout
    transport: TransportInfo
    max_seq_len: int = Field(gt=0)
    sender_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, ge=1)
    tilepd_version: str | None = None


class Region(_Msg):
    """One layer's region in the receive buffer, as offsets from the buffer start."""

    segment: Literal["kv", "indexer"] = "kv"
    layer: int
    offset: int
    length: int


class HelloOk(_Msg):
    type: Literal["hello_ok"] = "hello_ok"
    protocol: int
    transport: TransportInfo
    regions: list[Region]
    busy: bool
    node: str = ""


class Error(_Msg):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str


class Admit(_Msg):
    type: Literal["admit"] = "admit"
    transfer_id: str = Field(min_length=1, max_length=200)
    token: str = Field(min_length=1, max_length=200)
    seq_len: int = Field(gt=0)
    num_blocks: int = Field(gt=0)
    sender_rank: int = Field(default=0, ge=0)


class SegmentDst(_Msg):
    """Where one segment lands: its j-th layer's block i at base + j*region_stride + i*block_bytes."""

    base: int
    region_stride: int
    block_bytes: int


class Dst(SegmentDst):
    """Where the sender writes: layer l, block i lands at base + l*region_stride + i*block_bytes;
    a DSA layout's indexer layer j (its j-th entry of `layout.indexer.layers`) lands per `indexer`."""

    indexer: SegmentDst | None = None


class Accept(_Msg):
    type: Literal["accept"] = "accept"
    transfer_id: str
    generation: int
    dst: Dst


class Reject(_Msg):
    type: Literal["reject"] = "reject"
    transfer_id: str
    code: ErrorCode
    retryable: bool
    message: str


CHECKSUM_ALGORITHM = "xxh3_64"


class Done(_Msg):
    """`checksums`: one xxh3_64 (16 hex digits) per region the sender wrote, in `CacheLayout.regions` order,
    computed over the bytes it staged; the decode node verifies them before the transfer counts as complete."""

    type: Literal["done"] = "done"
    transfer_id: str
    generation: int
    bytes: int = Field(ge=0)
    ok: bool
    error: str | None = None
    checksum: Literal["xxh3_64"] = CHECKSUM_ALGORITHM
    checksums: list[Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]] = Field(default_factory=list, max_length=4096)


class Ack(_Msg):
    type: Literal["ack"] = "ack"
    transfer_id: str = ""
    ok: bool = True
    message: str = ""


Message = Annotated[
    Union[Hello, HelloOk, Error, Admit, Accept, Reject, Done, Ack],
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(Message)


def parse_message(obj: dict[str, Any]) -> Any:
    """Validate one decoded frame into its message model."""
    try:
        return _ADAPTER.validate_python(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ProtocolError(ErrorCode.MALFORMED, f"bad {obj.get('type', 'message')!r} frame at {where or '<root>'}: {first['msg']}") from exc


def dump(msg: BaseModel, *, exclude_none: bool = False) -> dict[str, Any]:
    """`exclude_none` leaves out unset optional fields: a v2 `hello` without an indexer segment then has exactly
    v1's keys, so a v1 decode node can read it and answer with its own version_mismatch message."""
    return msg.model_dump(mode="json", exclude_none=exclude_none)
