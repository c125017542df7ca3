"""Tool calls on the low-latency pool, through a router whose deployment names vLLM's `hermes` tool parser, with the
official `openai` client. The prefill vLLM (started with --enable-auto-tool-choice --tool-call-parser hermes) is the
reference: a named and a `required` tool_choice give the same tool calls (name and arguments) as it does alone,
streamed and not; the constraint vLLM's parser builds (an xgrammar structural tag) holds on the prefill's first token
and on the decode node's grammar; `auto` and `none` answer as it does; a malformed tool schema is a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tilepd.connector.launch import Server
from tilepd.contracts.service_configs import RouterConfig

from .conftest import Stack
from .stack import MODEL_NAME, TOOL_CALL_PARSER

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}, "days": {"enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}}, "required": ["city"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_router(router_stack: Stack, start_router_proc: Callable[..., tuple[Server, RouterConfig]]) -> OpenAI:
    srv, _ = start_router_proc(router_stack.config(native=False, tool_call_parser=TOOL_CALL_PARSER))
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _vllm(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    assert stack.prefill is not None
    r = httpx.post(stack.prefill.url + "/v1/chat/completions", json={"model": MODEL_NAME, **body}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]


def _calls(tool_calls: list[Any] | None) -> list[tuple[str, dict[str, Any]]]:
    return [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in tool_calls or []]


def _streamed(client: OpenAI, kw: dict[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], str | None, str]:
    """Tool calls assembled from delta.tool_calls (by index), the finish_reason, the route."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    with client.chat.completions.with_streaming_response.create(model=MODEL_NAME, stream=True, **kw) as resp:
        route = resp.headers["x-tilepd-route"]
        for chunk in resp.parse():
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            for tc in choice.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names[tc.index] = tc.function.name
                if tc.function and tc.function.arguments:
                    args[tc.index] = args.get(tc.index, "") + tc.function.arguments
            finish = choice.finish_reason or finish
    return [(names[i], json.loads(args[i])) for i in sorted(names)], finish, route


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_tool_calls_equal_vllm_alone(tool_router: OpenAI, router_stack: Stack, choice: Any) -> None:
    kw: dict[str, Any] = {"messages": CHAT, "tools": TOOLS, "tool_choice": choice, "max_tokens": 160, "temperature": 0}
    want = _vllm(router_stack, kw)
    want_calls = _calls(want["message"]["tool_calls"])
    assert want_calls and want["finish_reason"] == ("stop" if choice == NAMED else "tool_calls")
    if choice == NAMED:
        assert {name for name, _ in want_calls} == {"get_weather"}
    raw = tool_router.chat.completions.with_raw_response.create(model=MODEL_NAME, **kw)
    assert raw.headers["x-tilepd-route"] == "low_latency"
    got = raw.parse().choices[0]
    assert _calls([tc.model_dump() for tc in got.message.tool_calls or []]) == want_calls
    assert got.finish_reason == want["finish_reason"]
    assert (got.message.content or "") == (want["message"]["content"] or "")
    assert all(tc.id.startswith("chatcmpl-tool-") and tc.type == "function" for tc in got.message.tool_calls or [])
    calls, finish, route = _streamed(tool_router, kw)
    assert route == "low_latency" and calls == want_calls and finish == want["finish_reason"]


def test_auto_and_none_answer_as_vllm_alone(tool_router: OpenAI, router_stack: Stack) -> None:
    for choice in ("auto", "none"):
        kw: dict[str, Any] = {"messages": CHAT, "tools": TOOLS, "tool_choice": choice, "max_tokens": 12, "temperature": 0}
        want = _vllm(router_stack, kw)
        raw = tool_router.chat.completions.with_raw_response.create(model=MODEL_NAME, **kw)
        assert raw.headers["x-tilepd-route"] == "low_latency", choice
        got = raw.parse()
        assert got.choices[0].message.content == want["message"]["content"], choice
        assert _calls([tc.model_dump() for tc in got.choices[0].message.tool_calls or []]) == _calls(want["message"].get("tool_calls"))
        assert got.choices[0].finish_reason == want["finish_reason"], choice


def test_malformed_tool_schema_is_a_400_naming_the_field(tool_router: OpenAI) -> None:
    bad_type = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object",
                                                  "properties": {"a": {"type": "nope"}}}}}
    with pytest.raises(openai.BadRequestError) as exc:
        tool_router.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, tools=[WEATHER, bad_type],
                                            tool_choice={"type": "function", "function": {"name": "f"}})
    assert "tools[1].function.parameters" in str(exc.value) and "nope" in str(exc.value)
    not_a_schema = {"type": "function", "function": {"name": "f", "parameters": "not a schema"}}
    with pytest.raises(openai.BadRequestError) as exc:
        tool_router.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, tools=[not_a_schema],
                                            tool_choice="required")
    assert "tools[0].function.parameters" in str(exc.value)
    with pytest.raises(openai.BadRequestError) as exc:
        tool_router.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, tools=TOOLS,
                                            tool_choice={"type": "function", "function": {"name": "missing"}})
    assert "tool_choice" in str(exc.value)


def test_a_node_without_the_constraint_kind_sends_forced_tool_calls_to_the_native_pool(tiny_llama: Path) -> None:
    """The gate learns the constraint kinds from the node's capabilities: on an older node (no structural_tag) a
    tool_choice whose constraint the node would decode goes to the native pool; `auto` over non-strict tools, which
    vLLM's hermes parser leaves unconstrained (the router parses it), stays."""
    from tilepd.router.app import _Fallback, _tool_plan
    from tilepd.router.prompts import PromptRenderer
    from tilepd.router.protocol import ChatCompletionRequest
    from tilepd.router.tools import ToolCalling

    renderer = PromptRenderer(tiny_llama)
    renderer.tools = ToolCalling(TOOL_CALL_PARSER, renderer.tokenizer, MODEL_NAME)
    state: Any = type("S", (), {"renderer": renderer})()
    old = {"sampling": {"structured_output": ["json_schema", "json_object", "regex", "grammar"]}}
    new = {"sampling": {"structured_output": ["json_schema", "structural_tag"]}}
    for choice in ("required", NAMED, "auto"):
        body = {"model": MODEL_NAME, "messages": CHAT, "tools": TOOLS, "tool_choice": choice}
        req = ChatCompletionRequest.model_validate(body)
        with pytest.raises(_Fallback) as exc:
            _tool_plan(state, req, body, old)
        assert exc.value.reason == "unsupported:tool_choice" and exc.value.error.status == 501
        plan = _tool_plan(state, req, body, new)
        assert plan is not None and plan.structured is not None and plan.structured.node["type"] == "structural_tag"
    loose = [{"type": "function", "function": {k: v for k, v in WEATHER["function"].items() if k != "strict"}}]
    body = {"model": MODEL_NAME, "messages": CHAT, "tools": loose, "tool_choice": "auto"}
    plan = _tool_plan(state, ChatCompletionRequest.model_validate(body), body, old)
    assert plan is not None and plan.structured is None and plan.tool_dicts[0]["function"]["name"] == "get_weather"


def test_gate_takes_tools_only_with_a_tool_parser_and_refuses_a_tool_history_by_name() -> None:
    from tilepd.router.gate import gate
    from tilepd.router.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=CHAT, tools=TOOLS, tool_choice="required")
    assert gate(req, {}).param == "tools"
    assert gate(req, {}, tool_parser=True) is None
    history = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                             "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    refusal = gate(ChatCompletionRequest(messages=history, tools=TOOLS), {}, tool_parser=True)
    assert refusal is not None and refusal.param == "messages[1].tool_calls"


def test_the_plan_gives_the_router_the_tool_parser_vllm_is_given() -> None:
    from tilepd.plan import build_plan
    from tilepd.topology import load_topology_text

    base = (Path(__file__).parents[1] / "topology" / "base_valid.yaml").read_text()
    assert '["--max-num-seqs", "64"]' in base
    for text, want in ((base, None),
                       (base.replace('["--max-num-seqs", "64"]', '["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]'), "hermes"),
                       (base.replace('["--max-num-seqs", "64"]', '["--tool-call-parser=llama3_json"]'), "llama3_json")):
        plan = build_plan(load_topology_text(text))
        assert RouterConfig.model_validate(plan.service("router").config).tool_call_parser == want


def test_a_slow_tool_schema_gets_a_400_while_the_router_serves_others(router_stack: Stack,
                                                                      start_router_proc: Callable[..., tuple[Server, RouterConfig]]) -> None:
    """A tool schema whose xgrammar compile takes ~20 s on the 2-core box (20000 array items of a bounded string):
    compiled in the render pool under `prompt_render.timeout_s` (3 s here), it gets a 400 naming the limit, and a plain
    completion sent meanwhile is answered first. The old router compiled it on its event loop: the plain one waited."""
    import threading
    import time

    from tilepd.contracts.service_configs import PromptRenderConfig

    n = 20000
    slow = {"type": "function", "function": {"name": "fill", "description": "Fill a list", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "minItems": n, "maxItems": n, "items": {
            "type": "object", "properties": {"x": {"type": "string", "pattern": f"[a-z]{{1,{n}}}"}}}}},
        "required": ["a"], "additionalProperties": False}}}
    srv, _ = start_router_proc(router_stack.config(native=False, tool_call_parser=TOOL_CALL_PARSER,
                                                   prompt_render=PromptRenderConfig(timeout_s=3.0)))
    answered: dict[str, Any] = {}

    def tool_request() -> None:
        body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 8, "tools": [slow],
                "tool_choice": {"type": "function", "function": {"name": "fill"}}}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        answered["tool"] = (time.monotonic(), r)

    thread = threading.Thread(target=tool_request)
    thread.start()
    time.sleep(0.5)
    plain = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4,
                                                         "temperature": 0}, timeout=120)
    plain_at = time.monotonic()
    thread.join(150)
    assert plain.status_code == 200, plain.text
    tool_at, r = answered["tool"]
    assert plain_at < tool_at, "the plain completion waited for the tool schema's compile"
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"]) == (400, "prompt_render_limit", "tools"), err
    assert "over 3 s (prompt_render.timeout_s)" in err["message"], err
