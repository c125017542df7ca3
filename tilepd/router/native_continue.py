"""Continuing a low-latency request on the native pool when no low-latency node can take it.

The native pool is asked for the rest of the request as token ids: prompt + tokens already
sent become the prompt (prefilled with `do_remote_decode`, pulled by the native decode),
`max_tokens` is what is left, sampling is the request's, and vLLM streams each token as
`token_id:N` (`return_tokens_as_token_ids`, logprobs 1). The router's own detokenizer and
stop matcher, which saw the tokens already sent, turn them into text, so the client's
stream goes on as if one node had served it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from tilepd.router.logprobs import token_id
from tilepd.router.errors import PassThroughError, RouterError
from tilepd.router.native import native_stream
from tilepd.router.state import RouterState


async def native_tokens(state: RouterState, context_ids: list[int], max_tokens: int, sampling: dict[str, Any],
                        request_id: str) -> AsyncIterator[int]:
    """The token ids the native pool generates after `context_ids`; raises RouterError when it cannot."""
    body = {"model": state.config.served_model_name, "prompt": context_ids, "max_tokens": max_tokens, "stream": True,
            "logprobs": 1, "return_tokens_as_token_ids": True, **sampling}
    try:
        resp = await native_stream(state, "/v1/completions", body, request_id)
    except PassThroughError as exc:
        detail = exc.body[:300].decode("utf-8", "replace")
        raise RouterError(502, f"the native pool refused the continuation: {exc.status} {detail}", type="decode_node_error",
                          code="continuation_failed") from None
    if resp.status != 200:
        raw = await resp.aread()
        raise RouterError(502, f"the native decode refused the continuation: {resp.status} {raw[:300].decode('utf-8', 'replace')}",
                          type="decode_node_error", code="continuation_failed")
    pending = b""
    try:
        async for chunk in resp.chunks():
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for token in _tokens(event):
                    yield token
    finally:
        await resp.aclose()


def _tokens(event: bytes) -> list[int]:
    data = event.strip()
    if not data.startswith(b"data:"):
        return []
    data = data[len(b"data:"):].strip()
    if data == b"[DONE]":
        return []
    try:
        msg = json.loads(data)
        if "error" in msg:
            raise RouterError(502, f"the native pool failed the continuation: {msg['error']}", type="decode_node_error",
                              code="continuation_failed")
        tokens = (msg["choices"][0].get("logprobs") or {}).get("tokens") or [] if msg.get("choices") else []
        return [token_id(t) for t in tokens]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RouterError(502, f"the native pool sent an event without token ids: {exc}", type="decode_node_error",
                          code="continuation_failed") from exc
