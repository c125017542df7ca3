"""Property-based fuzzing of the router's request bodies: arbitrary JSON (and near-valid OpenAI bodies)
posted to /v1/completions and /v1/chat/completions of the in-process app never get a 500, a
traceback or a hang; bounded fields are refused with a 400 naming the field.

The app is the real one (real tokenizer and chat template). Its one decode node is a real node's
HTTP API in this process (tests/runtime/inprocess_node.py), marked in rotation with the
capabilities a CPU node reports, and its prefill sits on a closed port, so a request that passes
every check reserves the node (node API 2) and ends in a typed 502 from the prefill call: the
whole path up to the network is exercised, in milliseconds per example.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.runtime.inprocess_node import inprocess_node
from tilepd.connector.launch import free_port
from tilepd.contracts.service_configs import DecodeEndpoint, RouterConfig
from tilepd.router import protocol
from tilepd.router.app import MAX_JSON_DEPTH, create_app
from tilepd.router.auth import ApiKeys
from tilepd.router.upstream import Upstream

MODEL = "tiny-llama"
CAPS = {"max_seq_len": 1024, "sampling": {"temperature": True, "top_p": True, "top_k": True, "seed": True, "stop_token_ids": True,
                                          "ignore_eos": True, "max_tokens": True,
                                          "structured_output": ["json_schema", "json_object", "regex", "grammar"]}}
# typed answers a fuzzed body may get: refused (400/404/413/501) or, having passed every check, the unreachable prefill (502)
ALLOWED = {400, 404, 413, 501, 502}
BODY_LIMIT = 256 * 1024


class InProcess:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")

    def post(self, path: str, content: bytes) -> httpx.Response:
        call = self.client.post(path, content=content, headers={"content-type": "application/json"})
        return self.loop.run_until_complete(asyncio.wait_for(call, timeout=20))


@pytest.fixture(scope="module")
def router(tiny_llama: Path) -> Iterator[InProcess]:
    with inprocess_node(tiny_llama) as (svc, _engine, _url):
        yield from _router(tiny_llama, svc.config.http_port, svc.ctrl.port)


def _router(tiny_llama: Path, node_http_port: int, node_ctrl_port: int) -> Iterator[InProcess]:
    closed = free_port()  # nothing listens here
    config = RouterConfig(port=free_port(), served_model_name=MODEL, tokenizer_dir=tiny_llama, prefill_urls=(f"http://127.0.0.1:{closed}",),
                          decode_nodes=(DecodeEndpoint(name="d0", host="127.0.0.1", ctrl_port=node_ctrl_port, http_port=node_http_port),),
                          max_body_bytes=BODY_LIMIT)
    app = create_app(config, ApiKeys(keys=()))
    state = app.state.router
    state.client = Upstream(connect_timeout_s=1.0, read_timeout_s=5.0, connect_retries=0)
    node = state.pool.nodes[0]
    node.capabilities = CAPS
    state.pool.set_in_rotation(node, True)
    r = InProcess(app)
    yield r
    r.loop.run_until_complete(r.client.aclose())
    r.loop.run_until_complete(state.client.aclose())
    r.loop.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "stop_token_ids", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "ignore_eos", "user",
          "include_stop_str_in_output", "skip_special_tokens", "best_of", "tools", "response_format", "chat_template_kwargs",
          "continue_final_message", "add_generation_prompt", "kv_transfer_params", "presence_penalty", "min_tokens",
          "structured_outputs"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | st.text(max_size=5)},
                                optional={"content": json_values | st.text(max_size=30), "name": json_values})
# bodies near the real shape, so validation, the gate, the template and the planner all see odd values
near_valid = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "other"]) | json_values},
    optional={**{f: json_values for f in FIELDS if f != "model"},
              "prompt": st.text(max_size=40) | st.lists(st.integers(min_value=-5, max_value=40000), max_size=8) | json_values,
              "messages": st.lists(message, max_size=3) | json_values,
              "max_tokens": st.integers(min_value=-2, max_value=5000) | json_values,
              "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object",
                                                                     "structural_tag", "whitespace_pattern", "x"]),
                                                    json_values | st.text(max_size=20), max_size=2) | json_values,
              "stream": st.booleans()},
)


def _check(resp: httpx.Response) -> None:
    assert resp.status_code in ALLOWED, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert isinstance(body["error"]["message"], str) and "Traceback" not in resp.text


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@FUZZ
@given(body=near_valid | json_values)
def test_any_json_body_gets_a_typed_answer(router: InProcess, path: str, body: Any) -> None:
    _check(router.post(path, json.dumps(body).encode()))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_any_bytes_get_a_typed_answer(router: InProcess, path: str, raw: bytes) -> None:
    _check(router.post(path, raw))


@pytest.mark.parametrize("field,value,param", [
    ("stop", ["s"] * (protocol.MAX_STOP + 1), "stop"),
    ("stop", "x" * (protocol.MAX_STOP_CHARS + 1), "stop"),
    ("max_tokens", protocol.MAX_TOKENS + 1, "max_tokens"),
    ("user", "u" * (protocol.MAX_NAME_CHARS + 1), "user"),
    ("stop_token_ids", [1] * (protocol.MAX_STOP_TOKEN_IDS + 1), "stop_token_ids"),
    ("prompt", [-1, 2], "prompt"),
    ("temperature", float("nan"), "temperature"),
    ("seed", 1 << 70, "seed"),
])
def test_bounded_fields_are_refused_by_name(router: InProcess, field: str, value: Any, param: str) -> None:
    body = {"model": MODEL, "prompt": "hi", field: value}
    resp = router.post("/v1/completions", json.dumps(body).encode())
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].split(".")[0] == param


def test_message_count_and_nesting_are_bounded(router: InProcess) -> None:
    many = {"model": MODEL, "messages": [{"role": "user", "content": "a"}] * (protocol.MAX_MESSAGES + 1)}
    resp = router.post("/v1/chat/completions", json.dumps(many).encode())
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = [deep]
    resp = router.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "metadata": deep}).encode())
    assert resp.status_code == 400 and resp.json()["error"]["param"].startswith("metadata")
    very_deep = b'{"a": ' + b"[" * 20000 + b"]" * 20000 + b"}"  # json.loads alone would raise RecursionError
    resp = router.post("/v1/completions", very_deep)
    assert resp.status_code in (400, 413)
    big = {"model": MODEL, "prompt": "x" * BODY_LIMIT}
    assert router.post("/v1/completions", json.dumps(big).encode()).status_code == 413


def test_a_valid_body_reaches_the_prefill(router: InProcess) -> None:
    """The harness is not refusing everything: a valid request gets as far as the (closed) prefill port."""
    resp = router.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3}).encode())
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "prefill_unreachable"


def test_the_capability_gate_uses_the_last_known_capabilities_while_no_node_is_up(router: InProcess) -> None:
    """A request no node could decode is refused as unsupported by name, not as "no node": the answer must not
    depend on whether a health check happened to miss at that instant (CI, 2026-11-30)."""
    node = router.app.state.router.pool.nodes[0]
    router.app.state.router.pool.set_in_rotation(node, False)
    try:
        refused = router.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "n": 2}).encode())
        assert refused.status_code == 501 and refused.json()["error"]["param"] == "n", refused.text
        down = router.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3}).encode())
        assert down.status_code == 503 and down.json()["error"]["code"] == "no_decode_node", down.text
    finally:
        router.app.state.router.pool.set_in_rotation(node, True)
