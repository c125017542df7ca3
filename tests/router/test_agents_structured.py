"""Structured output (`response_format` JSON schema) on the low-latency pool, through the router with the
official `openai` client: the prefill samples the first token under the schema, the decode node's xgrammar
matcher constrains the rest; the output validates and equals a stock vLLM's (the prefill vLLM, no marker)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from .conftest import Stack
from .stack import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
CHAT = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]


@pytest.fixture(scope="module")
def client(plain_router: tuple[str, Any]) -> OpenAI:
    return OpenAI(base_url=plain_router[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def _vllm(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    assert stack.prefill is not None
    r = httpx.post(stack.prefill.url + "/v1/chat/completions", json={"model": MODEL_NAME, **body}, timeout=120)
    r.raise_for_status()
    return r.json()


def test_json_schema_equals_vllm_and_validates(client: OpenAI, router_stack: Stack) -> None:
    kw: dict[str, Any] = {"messages": CHAT, "max_tokens": 128, "temperature": 0, "response_format": FORMAT}
    want = _vllm(router_stack, kw)["choices"][0]
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, **kw)
    assert raw.headers["x-tilepd-route"] == "low_latency"
    got = raw.parse().choices[0]
    assert got.finish_reason == want["finish_reason"] == "stop"
    assert got.message.content == want["message"]["content"]
    jsonschema.validate(json.loads(got.message.content), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(model=MODEL_NAME, stream=True, **kw)
                       if c.choices)
    assert streamed == got.message.content


def test_malformed_schema_is_a_400_naming_the_field(client: OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0, response_format=bad)
    assert "response_format.json_schema.schema" in str(exc.value)


def test_gate_sends_constraints_only_to_nodes_that_declare_them() -> None:
    from tilepd.router.gate import gate
    from tilepd.router.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=CHAT, response_format=FORMAT)
    assert gate(req, {"logprobs": True}).param == "response_format"
    assert gate(req, {"structured_output": ["json_object"]}).param == "response_format"
    assert gate(req, {"structured_output": ["json_schema", "json_object"]}) is None


def test_schema_refused_by_the_prefill_is_a_400_naming_the_field(client: OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0, response_format=bad)
    assert "response_format.json_schema.schema" in str(exc.value) and "nope" in str(exc.value)


def test_node_refuses_bad_constraints_by_field(router_stack: Stack) -> None:
    """Checked before the slot is touched: no transfer is needed to see them."""
    body: dict[str, Any] = {"transfer_id": "tx-agents", "token": "t", "first_token": 5, "prompt_tokens": 3}

    def post(so: dict[str, str]) -> tuple[int, dict[str, Any]]:
        r = httpx.post(router_stack.decode_url + "/v1/decode", json={**body, "structured_output": so}, timeout=60)
        return r.status_code, r.json()["error"]

    status, err = post({"type": "json_schema", "spec": json.dumps({"type": "nope"})})
    assert status == 400 and err["param"] == "structured_output.spec"
    status, err = post({"type": "json_schema", "spec": "{not json"})
    assert status == 400 and err["param"] == "structured_output.spec"
    status, err = post({"type": "choice", "spec": "[]"})
    assert status == 501 and err["param"] == "structured_output.type"
    status, err = post({"type": "regex", "spec": "a+"})  # token 5 cannot start "a+": the prefill did not sample it under it
    assert status == 400 and err["param"] == "first_token"
    assert not httpx.get(router_stack.decode_url + "/status", timeout=5).json()["busy"]
