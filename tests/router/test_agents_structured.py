"""Structured output (`response_format` JSON schema, vLLM's `structured_outputs` json / regex / choice / grammar)
on the low-latency pool, through the router with the official `openai` client: the prefill samples the first token
under the constraint, the decode node's xgrammar matcher constrains the rest; the output obeys it and equals a stock
vLLM's (the prefill vLLM, no marker, same structured-output backend)."""

from __future__ import annotations

import json
import re
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


def _vllm(stack: Stack, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    assert stack.prefill is not None
    r = httpx.post(stack.prefill.url + path, json={"model": MODEL_NAME, **body}, timeout=120)
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
    body: dict[str, Any] = {"transfer_id": "tx-agents", "token": "t", "fence": 0, "first_token": 5, "prompt_tokens": 3}

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


# --- vLLM's `structured_outputs` field (json / regex / choice / grammar), completions and chat ---

PROMPT = "The three primary colors are"
YEAR = r"(19|20)[0-9]{2}"
COLORS = ["red", "green", "blue", "dark \"purple\""]
EBNF = 'root ::= answer " because " reason "."\nanswer ::= "yes" | "no"\nreason ::= [a-z]{1,8} (" " [a-z]{1,8})?'
EBNF_RE = r"(yes|no) because [a-z]{1,8}( [a-z]{1,8})?\."


def _completion_equals_vllm(client: OpenAI, stack: Stack, so: dict[str, Any], stream: bool,
                           max_tokens: int = 24) -> tuple[str, str]:
    """The router's text and finish_reason (low-latency route) for a completions request under `so`, asserted equal to
    vLLM alone's."""
    kw: dict[str, Any] = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    want = _vllm(stack, {**kw, "structured_outputs": so}, "/v1/completions")["choices"][0]
    with client.completions.with_streaming_response.create(model=MODEL_NAME, stream=stream, extra_body={"structured_outputs": so},
                                                           **kw) as resp:
        assert (resp.headers["x-tilepd-route"], resp.headers["x-tilepd-route-reason"]) == ("low_latency", "default")
        parsed = resp.parse()
        if stream:
            chunks = [c.choices[0] for c in parsed if c.choices]
            text, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
        else:
            text, finish = parsed.choices[0].text, parsed.choices[0].finish_reason
    assert (text, finish) == (want["text"], want["finish_reason"])
    return text, finish


def _chat_equals_vllm(client: OpenAI, stack: Stack, so: dict[str, Any], stream: bool, max_tokens: int = 24) -> tuple[str, str]:
    kw: dict[str, Any] = {"messages": CHAT, "max_tokens": max_tokens, "temperature": 0}
    want = _vllm(stack, {**kw, "structured_outputs": so})["choices"][0]
    with client.chat.completions.with_streaming_response.create(model=MODEL_NAME, stream=stream, extra_body={"structured_outputs": so},
                                                                **kw) as resp:
        assert (resp.headers["x-tilepd-route"], resp.headers["x-tilepd-route-reason"]) == ("low_latency", "default")
        parsed = resp.parse()
        if stream:
            chunks = [c.choices[0] for c in parsed if c.choices]
            text, finish = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
        else:
            text, finish = parsed.choices[0].message.content or "", parsed.choices[0].finish_reason
    assert (text, finish) == (want["message"]["content"], want["finish_reason"])
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_regex_equals_vllm(client: OpenAI, router_stack: Stack, stream: bool) -> None:
    assert re.fullmatch(YEAR, _completion_equals_vllm(client, router_stack, {"regex": YEAR}, stream)[0])
    assert re.fullmatch(YEAR, _chat_equals_vllm(client, router_stack, {"regex": YEAR}, stream)[0])


@pytest.mark.parametrize("stream", [False, True])
def test_choice_equals_vllm(client: OpenAI, router_stack: Stack, stream: bool) -> None:
    assert _completion_equals_vllm(client, router_stack, {"choice": COLORS}, stream)[0] in COLORS
    assert _chat_equals_vllm(client, router_stack, {"choice": COLORS}, stream)[0] in COLORS


@pytest.mark.parametrize("stream", [False, True])
def test_ebnf_grammar_equals_vllm(client: OpenAI, router_stack: Stack, stream: bool) -> None:
    assert re.fullmatch(EBNF_RE, _completion_equals_vllm(client, router_stack, {"grammar": EBNF}, stream, max_tokens=48)[0])
    assert re.fullmatch(EBNF_RE, _chat_equals_vllm(client, router_stack, {"grammar": EBNF}, stream, max_tokens=48)[0])


def _valid_json_so_far(text: str, finish: str, schema: dict[str, Any]) -> None:
    """A finished answer validates; one cut by max_tokens (the tiny model may pad with the whitespace JSON allows) is an
    object under way."""
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert finish == "length" and text.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_json_via_structured_outputs_equals_vllm_and_validates(client: OpenAI, router_stack: Stack, stream: bool) -> None:
    text, finish = _chat_equals_vllm(client, router_stack, {"json": SCHEMA}, stream, max_tokens=128)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    _valid_json_so_far(*_completion_equals_vllm(client, router_stack, {"json": json.dumps(SCHEMA)}, stream, max_tokens=128), SCHEMA)


def test_json_object_via_structured_outputs_equals_vllm(client: OpenAI, router_stack: Stack) -> None:
    _valid_json_so_far(*_completion_equals_vllm(client, router_stack, {"json_object": True}, False, max_tokens=64), {"type": "object"})


@pytest.mark.parametrize("so,param", [
    ({"regex": "(a"}, "structured_outputs.regex"), ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
])
def test_malformed_constraint_is_a_400_naming_the_field_as_vllm_refuses_it(client: OpenAI, router_stack: Stack,
                                                                           so: dict[str, Any], param: str) -> None:
    assert router_stack.prefill is not None
    alone = httpx.post(router_stack.prefill.url + "/v1/completions", timeout=120,
                       json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "structured_outputs": so})
    assert alone.status_code == 400, alone.text
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body={"structured_outputs": so})
    assert exc.value.response.json()["error"]["param"] == param


@pytest.mark.parametrize("so,param", [
    ({"regex": YEAR, "whitespace_pattern": "[ ]?"}, "structured_outputs.whitespace_pattern"),
    ({"json": SCHEMA, "disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace"),
    ({"grammar": 'start: "yes" | "no"'}, "structured_outputs.grammar"),  # Lark
])
def test_what_the_node_cannot_honour_goes_native_by_name(native_router: tuple[str, Any], so: dict[str, Any], param: str) -> None:
    native = OpenAI(base_url=native_router[0] + "/v1", api_key="unused", max_retries=0, timeout=300)
    raw = native.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                                      extra_body={"structured_outputs": so})
    assert (raw.headers["x-tilepd-route"], raw.headers["x-tilepd-route-reason"]) == ("native", f"unsupported:{param}")


def test_choice_grammar_and_lark_test_are_vllms() -> None:
    """The router re-states two vLLM functions (to keep vLLM out of a router without tools): they must agree."""
    from vllm.v1.structured_output.utils import choice_as_grammar, grammar_is_likely_lark

    from tilepd.router import structured

    for choice in (COLORS, ["a\\b", "tab\there", "nl\n", "\x01\x7f", "ünï"]):
        assert structured.choice_as_grammar(choice) == choice_as_grammar(choice)
    for grammar in (EBNF, 'start: "a"', '# x ::= y\nstart: "a"', 'root ::= "a" // c', "", "  "):
        assert structured.is_lark(grammar) == grammar_is_likely_lark(grammar)
