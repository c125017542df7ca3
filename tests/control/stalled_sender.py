"""A sender that stops mid-transfer (run as a subprocess and killed by the test).

The real KVSender never stalls on demand, so this script speaks the real protocol
(hello, admit, tcp data frames) and then stops after part of the payload, which is
the fault the test injects: a prefill process that dies mid-transfer.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

from tilepd.control.framing import recv_frame, send_frame
from tilepd.control.messages import PROTOCOL_VERSION

host, port, layout_json, transfer_id, token, seq_len, num_blocks = sys.argv[1:8]
ctrl = socket.create_connection((host, int(port)))
send_frame(ctrl, {"type": "hello", "protocol": PROTOCOL_VERSION, "layout": json.loads(layout_json), "transport": {"name": "tcp", "metadata": {}},
                  "max_seq_len": int(seq_len), "sender_rank": 0, "tp_size": 1})
ok = recv_frame(ctrl)
assert ok["type"] == "hello_ok", ok
send_frame(ctrl, {"type": "admit", "transfer_id": transfer_id, "token": token, "seq_len": int(seq_len), "num_blocks": int(num_blocks)})
acc = recv_frame(ctrl)
assert acc["type"] == "accept", acc
md = ok["transport"]["metadata"]
data = socket.create_connection((md["host"], md["port"]))
data.sendall(struct.pack(">4sQQQ", b"TPD1", acc["generation"], 0, acc["dst"]["block_bytes"]) + b"\xee" * 100)
print("stalled", flush=True)
time.sleep(3600)
