"""tilepd.control: the control protocol between the prefill connector and a decode node.

Framing (`framing`), messages and error codes (`messages`), the wire cache layout
(`cache_layout.CacheLayout`), compatibility checks (`compat`) and the connector-side
API (`sender.KVSender`). See docs/INTERFACES.md §2-§3.
"""

from tilepd.control.cache_layout import LAYOUT_VERSION, CacheLayout
from tilepd.control.messages import PROTOCOL_VERSION, ErrorCode, ProtocolError

__all__ = ["LAYOUT_VERSION", "PROTOCOL_VERSION", "CacheLayout", "ErrorCode", "ProtocolError"]
