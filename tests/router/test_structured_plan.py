"""response_format / structured_outputs on the low-latency path, without processes: which requests the gate keeps
(the node must compile the one constraint as vLLM's xgrammar backend does), which it sends native by name, what the
prefill and the node get, and the 400s that name the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tilepd.router.app import _validate
from tilepd.router.errors import RouterError
from tilepd.router.gate import gate
from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest
from tilepd.router.structured import choice_as_grammar, is_lark, structured_plan

KINDS = ["json_schema", "json_object", "regex", "grammar", "structural_tag"]  # tilepd.engine.grammar.KINDS
CAPS = {"temperature": True, "structured_output": KINDS}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
RF_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
EBNF = 'root ::= "yes" | "no"'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _req(endpoint: str, **kw: Any) -> CompletionRequest | ChatCompletionRequest:
    base = {"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    return _validate(endpoint, {"model": "m", **base, **kw})  # type: ignore[arg-type]


ENDPOINTS = pytest.mark.parametrize("endpoint", ["completions", "chat"])


@ENDPOINTS
@pytest.mark.parametrize("so", [
    {"regex": "[0-9]{3}"}, {"choice": ["red", "green"]}, {"grammar": EBNF}, {"json": SCHEMA}, {"json": '{"type": "string"}'},
    {"json_object": True}, {"regex": "a+", "disable_any_whitespace": False, "whitespace_pattern": None},
])
def test_served_constraints_pass_the_gate(endpoint: str, so: dict[str, Any]) -> None:
    assert gate(_req(endpoint, structured_outputs=so), CAPS) is None


@ENDPOINTS
@pytest.mark.parametrize("kw,param", [
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": "[ ]?"}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}}, "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": {"structural_tag": '{"structures": [], "triggers": []}'}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "grammar": EBNF}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs.frobnicate"),
    ({"structured_outputs": {"grammar": "start: \"yes\" | \"no\""}}, "structured_outputs.grammar"),  # Lark
    ({"structured_outputs": {"regex": "a"}, "response_format": RF_SCHEMA}, "structured_outputs"),  # two kinds: vLLM's 400
    ({"structured_outputs": {"grammar": EBNF}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
])
def test_what_the_node_cannot_honour_is_refused_by_name(endpoint: str, kw: dict[str, Any], param: str) -> None:
    refusal = gate(_req(endpoint, **kw), CAPS)
    assert refusal is not None and refusal.param == param


@ENDPOINTS
@pytest.mark.parametrize("so,param,kinds", [
    ({"regex": "a"}, "structured_outputs.regex", ["json_schema", "json_object"]),
    ({"choice": ["a"]}, "structured_outputs.choice", ["json_schema", "regex"]),  # choice compiles as a grammar
    ({"json": SCHEMA}, "structured_outputs.json", ["regex"]),
    ({"json_object": True}, "structured_outputs.json_object", ["json_schema"]),
])
def test_an_older_node_without_the_kind_sends_it_native(endpoint: str, so: dict[str, Any], param: str, kinds: list[str]) -> None:
    refusal = gate(_req(endpoint, structured_outputs=so), {"structured_output": kinds})
    assert refusal is not None and refusal.param == param


def test_structured_outputs_with_tools_goes_native() -> None:
    """vLLM's tool parser sets (or keeps) the structured_outputs then; that mix is the native pool's."""
    for kw in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}, {"tools": TOOLS, "tool_choice": "required"},
               {"tools": TOOLS, "tool_choice": "none"}):
        refusal = gate(_req("chat", structured_outputs={"regex": "a"}, **kw), CAPS, tool_parser=True)
        assert refusal is not None and refusal.param == "structured_outputs"


@ENDPOINTS
@pytest.mark.parametrize("so,node", [
    ({"regex": "[0-9]{3}"}, {"type": "regex", "spec": "[0-9]{3}"}),
    ({"choice": ["red", "green"]}, {"type": "grammar", "spec": 'root ::= "red" | "green"'}),
    ({"grammar": EBNF}, {"type": "grammar", "spec": EBNF}),
    ({"json": SCHEMA}, {"type": "json_schema", "spec": json.dumps(SCHEMA)}),
    ({"json": '{"type":"string"}'}, {"type": "json_schema", "spec": '{"type":"string"}'}),
    ({"json_object": True}, {"type": "json_object", "spec": ""}),
])
def test_the_prefill_gets_the_field_unchanged_and_the_node_its_kind(endpoint: str, so: dict[str, Any], node: dict[str, str]) -> None:
    plan = structured_plan(_req(endpoint, structured_outputs=so))
    assert plan is not None
    assert plan.prefill == {"structured_outputs": so}
    assert plan.node == node
    assert plan.field == f"structured_outputs.{next(iter(so))}"


@ENDPOINTS
def test_response_format_replaces_the_field_of_its_kind_as_vllm_does(endpoint: str) -> None:
    """vLLM's structured_outputs_from_response_format: response_format's schema wins over structured_outputs.json."""
    so = {"json": {"type": "string"}}
    plan = structured_plan(_req(endpoint, structured_outputs=so, response_format=RF_SCHEMA))
    assert plan is not None and plan.prefill == {"structured_outputs": so, "response_format": RF_SCHEMA}
    assert plan.node["type"] == "json_schema" and '"ok"' in plan.node["spec"]
    assert plan.field == "response_format.json_schema.schema"
    plan = structured_plan(_req(endpoint, structured_outputs={"json_object": False}, response_format={"type": "json_object"}))
    assert plan is not None and plan.node == {"type": "json_object", "spec": ""}  # vLLM sets json_object=True


def test_completions_take_response_format_too() -> None:
    assert gate(_req("completions", response_format=RF_SCHEMA), CAPS) is None
    plan = structured_plan(_req("completions", response_format={"type": "json_object"}))
    assert plan is not None and plan.node == {"type": "json_object", "spec": ""}
    refusal = gate(_req("completions", response_format=RF_SCHEMA), {"structured_output": ["regex"]})
    assert refusal is not None and refusal.param == "response_format"


@ENDPOINTS
@pytest.mark.parametrize("so,param", [
    ({"choice": []}, "structured_outputs.choice"), ({"json": " "}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"), ({"grammar": "  "}, "structured_outputs.grammar"),
    ({"json_object": False}, "structured_outputs.json_object"), ({"regex": "a\x00"}, "structured_outputs.regex"),
    ({}, "structured_outputs"), ({"disable_any_whitespace": False}, "structured_outputs"),
])
def test_malformed_constraints_are_400s_naming_the_field(endpoint: str, so: dict[str, Any], param: str) -> None:
    req = _req(endpoint, structured_outputs=so)
    assert gate(req, CAPS) is None  # ours to answer: vLLM answers these with a 400 whatever the backend
    with pytest.raises(RouterError) as exc:
        structured_plan(req)
    assert exc.value.status == 400 and exc.value.param == param


@ENDPOINTS
@pytest.mark.parametrize("so,param", [
    ({"regex": 5}, "structured_outputs.regex"), ({"choice": "abc"}, "structured_outputs.choice"),
    ({"choice": [1, 2]}, "structured_outputs.choice.0"), ({"json_object": "maybe"}, "structured_outputs.json_object"),
    ("regex", "structured_outputs"),
])
def test_wrong_types_are_400s_naming_the_field_as_vllm_does(endpoint: str, so: Any, param: str) -> None:
    with pytest.raises(RouterError) as exc:
        _req(endpoint, structured_outputs=so)
    assert exc.value.status == 400 and exc.value.param == param


def test_choice_grammar_escapes_as_vllm() -> None:
    assert choice_as_grammar(['a"b', "x\ny", "\\", "t\tab\x01\x7f"]) == r'root ::= "a\"b" | "x\ny" | "\\" | "t\tab\u0001\u007f"'


def test_lark_is_told_from_ebnf_as_vllm_does() -> None:
    assert not is_lark(EBNF)
    assert not is_lark('# comment\nroot ::= "a"  // trailing')
    assert is_lark('start: "a"')
    assert is_lark('# root ::= "a"\nstart: "a"')  # a commented-out rule does not count
