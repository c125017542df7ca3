"""An OTLP/HTTP traces receiver for the tests: the role of a collector, in this process (no collector binary can be
installed on the CI box). It decodes each `ExportTraceServiceRequest` protobuf POSTed to /v1/traces and keeps the spans."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """An OTLP/HTTP traces receiver: POST /v1/traces with a protobuf ExportTraceServiceRequest."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[Any] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                ok = self.path == "/v1/traces"
                if ok:
                    req = ExportTraceServiceRequest()
                    req.ParseFromString(raw)
                    with lock:
                        outer.spans += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
                self.send_response(200 if ok else 404)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # the kernel picks a free port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def trace_of(self, request_id: str) -> list[Any]:
        roots = [s for s in list(self.spans) if any(a.key == "tilepd.request_id" and a.value.string_value == request_id for a in s.attributes)]
        return [s for s in list(self.spans) if roots and s.trace_id == roots[0].trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
