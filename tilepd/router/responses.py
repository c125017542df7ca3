"""OpenAI response bodies and SSE chunks, chat and completions alike.

Per-token chunks are the router's hot path, so each request pre-renders the JSON
around the text once and only escapes the text per chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from starlette.responses import StreamingResponse
from starlette.types import Send

Endpoint = Literal["chat", "completions"]
DONE = b"data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response whose `[DONE]` chunk also ends the HTTP body.

    Starlette ends a streamed body with a separate empty chunk: one more socket write and
    client wake-up per request. Here the chunk that carries `data: [DONE]` is sent as the
    last one; the iterator is still run to its end (its `finally` settles the request).
    """

    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            if ended:
                raise RuntimeError("an SSE stream yielded more after data: [DONE]")
            data = chunk if isinstance(chunk, bytes) else str(chunk).encode()
            ended = data.endswith(DONE)
            await send({"type": "http.response.body", "body": data, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class ResponseWriter:
    """Builds the bodies of one response."""

    def __init__(self, endpoint: Endpoint, model: str) -> None:
        self.endpoint = endpoint
        self.model = model
        self.created = int(time.time())
        if endpoint == "chat":
            self.id = f"chatcmpl-{uuid.uuid4().hex}"
            self.object = "chat.completion"
        else:
            self.id = f"cmpl-{uuid.uuid4().hex}"
            self.object = "text_completion"
        chunk_object = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        head = json.dumps({"id": self.id, "object": chunk_object, "created": self.created, "model": self.model})[:-1]
        if endpoint == "chat":
            self._text_head = (f'data: {head}, "choices": [{{"index": 0, "delta": {{"content": ').encode()
            self._text_tail = b'}, "logprobs": null, "finish_reason": null}]}\n\n'
        else:
            self._text_head = (f'data: {head}, "choices": [{{"index": 0, "text": ').encode()
            self._text_tail = b', "logprobs": null, "finish_reason": null}]}\n\n'
        self._chunk_base = {"id": self.id, "object": chunk_object, "created": self.created, "model": self.model}
        self.logprobs: Any = None  # a tilepd.router.logprobs.LogprobsRenderer when the request asked for logprobs
        self.tools: Any = None  # a tilepd.router.tools.ToolPlan: content and tool_calls parsed by vLLM's tool parser
        self._sent_chars = 0  # completions' text_offset in a stream starts at the text sent so far (as vLLM's)

    def role_chunk(self) -> bytes | None:
        """Chat streams open with the assistant role, as OpenAI's do."""
        if self.endpoint != "chat":
            return None
        return sse({**self._chunk_base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})

    def text_chunk(self, text: str, records: tuple = ()) -> bytes:
        if self.logprobs is None:
            return self._text_head + json.dumps(text).encode() + self._text_tail
        if self.endpoint == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": self.logprobs.chat(list(records))}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs.completions(list(records), self._sent_chars)}
            self._sent_chars += len(text)
        choice["finish_reason"] = None
        return sse({**self._chunk_base, "choices": [choice]})

    def delta_chunk(self, delta: dict[str, Any], records: tuple = ()) -> bytes:
        """A chat chunk with a delta someone else built (vLLM's tool parser: content and/or tool_calls)."""
        lp = self.logprobs.chat(list(records)) if self.logprobs is not None else None
        return sse({**self._chunk_base, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": None}]})

    def finish_chunk(self, finish_reason: str, stop_reason: str | int | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
        if self.endpoint == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return sse({**self._chunk_base, "choices": [choice]})

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse({**self._chunk_base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    def full(self, text: str, finish_reason: str, stop_reason: str | int | None, prompt_tokens: int, completion_tokens: int,
             records: list | None = None, message: dict[str, Any] | None = None) -> dict[str, Any]:
        """message: the chat message when someone else built it (vLLM's tool parser), else role + text."""
        lp: Any = None
        if self.logprobs is not None:
            lp = self.logprobs.chat(records or []) if self.endpoint == "chat" else self.logprobs.completions(records or [])
        if self.endpoint == "chat":
            choice: dict[str, Any] = {"index": 0, "message": message or {"role": "assistant", "content": text}, "logprobs": lp,
                                      "finish_reason": finish_reason, "stop_reason": stop_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": stop_reason}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def error_chunk(body: dict[str, Any]) -> bytes:
    """An error after the stream began: the status line is already sent, so it goes in-band."""
    return sse(body)
