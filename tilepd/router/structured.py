"""Structured output on the low-latency path: `response_format` (json_schema / json_object) and vLLM's
`structured_outputs` field (json / regex / choice / grammar / json_object), on chat and completions.

The same constraint goes twice: to the prefill vLLM as the client sent it (vLLM turns it into its
structured-output request exactly as for a direct call, so the first token obeys it), and to the decode
node as {"type", "spec"} (tilepd.engine.grammar), whose matcher starts after that first token. Each kind
reaches the node in the form vLLM 0.32's xgrammar backend compiles (`validate_xgrammar_grammar`,
`XgrammarBackend.compile_grammar`); `choice` becomes the EBNF grammar vLLM builds for it (`choice_as_grammar`).

Which kinds and options the node can honour is the gate's question (tilepd.router.gate); this module only
says what a request asks for and builds what the prefill and the node get.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tilepd.router.errors import invalid
from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest, StructuredOutputs

# vLLM's constraint fields (StructuredOutputsParams, v0.32) and the node kind that compiles each as vLLM's xgrammar backend does
NODE_KIND = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "grammar", "grammar": "grammar",
             "structural_tag": "structural_tag"}
# options of StructuredOutputsParams and their defaults; the node compiles with the defaults only
OPTION_DEFAULTS: dict[str, Any] = {"disable_any_whitespace": False, "disable_additional_properties": False, "whitespace_pattern": None}
# response_format type -> the structured_outputs field vLLM sets from it (structured_outputs_from_response_format)
RESPONSE_FORMAT_FIELD = {"json_schema": "json", "json_object": "json_object"}


@dataclass(frozen=True)
class StructuredPlan:
    prefill: dict[str, Any]  # fields merged into the prefill request
    node: dict[str, str]  # the decode node's `structured_output`
    field: str = "response_format"  # named in the 400 when the prefill vLLM refuses the constraint


def constraint_fields(so: Any) -> dict[str, Any]:
    """The constraint fields set (not None, as vLLM counts them) on a StructuredOutputs or a vLLM StructuredOutputsParams."""
    values = so.model_dump(by_alias=True) if isinstance(so, StructuredOutputs) else {k: getattr(so, k, None) for k in NODE_KIND}
    return {name: values.get(name) for name in NODE_KIND if values.get(name) is not None}


def options_set(so: Any) -> list[str]:
    """Options changed from their defaults: the node's compiler takes none of them, so such a request is not ours."""
    return [name for name, default in OPTION_DEFAULTS.items() if getattr(so, name, default) != default]


def requested_fields(req: CompletionRequest | ChatCompletionRequest) -> set[str]:
    """The structured_outputs fields vLLM would set: the client's plus the one its response_format overrides.
    More than one is vLLM's 400 ("only one kind of structured outputs constraint")."""
    fields = set(constraint_fields(req.structured_outputs)) if req.structured_outputs is not None else set()
    rf_type = (req.response_format or {}).get("type", "text")
    if rf_type in RESPONSE_FORMAT_FIELD:
        fields.add(RESPONSE_FORMAT_FIELD[rf_type])
    return fields


def is_lark(grammar: str) -> bool:
    """vLLM's `grammar_is_likely_lark`: no line defines a rule with `::=` (comments removed). vLLM compiles those
    with xgrammar's Lark front end; the node compiles EBNF only."""
    if not grammar:
        return False
    for line in grammar.split("\n"):
        line = re.sub(r"(#|//).*$", "", line).strip()
        if line and "::=" in line:
            return False
    return True


def choice_as_grammar(choice: list[str]) -> str:
    """vLLM's `choice_as_grammar` (v1/structured_output/utils.py): the EBNF its xgrammar backend compiles for `choice`,
    so the node allows exactly the tokens vLLM allows."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return f"\\u{ord(ch):04x}"
        return ch

    return "root ::= " + " | ".join('"' + "".join(escape(ch) for ch in c) + '"' for c in choice)


def structured_plan(req: CompletionRequest | ChatCompletionRequest) -> StructuredPlan | None:
    """None for plain text; a 400 naming the field when the constraint is malformed. The gate has already sent
    native what the node cannot honour (options, several kinds, structural tags, Lark grammars)."""
    from_rf = _response_format_plan(req.response_format)
    so = req.structured_outputs
    if so is None:
        return from_rf
    fields = constraint_fields(so)
    if not fields:
        raise invalid("structured_outputs", "You must use one kind of structured outputs constraint but none are specified")
    prefill = {"structured_outputs": so.model_dump(by_alias=True, exclude_unset=True)}
    if from_rf is not None:  # vLLM: response_format replaces the structured_outputs field of its own kind
        return StructuredPlan({**prefill, **from_rf.prefill}, from_rf.node, from_rf.field)
    if len(fields) > 1:  # the gate sends these native, where vLLM answers them
        raise invalid("structured_outputs", "You can only use one kind of structured outputs constraint")
    [(name, value)] = fields.items()
    return StructuredPlan(prefill, _node_constraint(name, value), f"structured_outputs.{name}")


def _node_constraint(name: str, value: Any) -> dict[str, str]:
    """The node's {"type", "spec"} for one structured_outputs field; the 400s vLLM's SamplingParams gives before any backend."""
    field = f"structured_outputs.{name}"
    if name == "json":
        if isinstance(value, dict):
            return {"type": "json_schema", "spec": json.dumps(value)}  # vLLM's get_structured_output_key
        if not value.strip():
            raise invalid(field, "structured_outputs.json cannot be an empty string")
        try:
            json.loads(value)
        except ValueError:
            raise invalid(field, "Invalid JSON grammar specification.") from None
        return {"type": "json_schema", "spec": value}
    if name == "json_object":
        if value is not True:
            raise invalid(field, "structured_outputs.json_object must be True if set; omit structured_outputs to disable "
                                 "structured outputs")
        return {"type": "json_object", "spec": ""}
    if name == "regex":
        if "\x00" in value:
            raise invalid(field, "structured_outputs.regex must not contain a NUL character ('\\x00')")
        return {"type": "regex", "spec": value}
    if name == "choice":
        if not value:
            raise invalid(field, f"Choice '{value}' cannot be an empty list")
        return {"type": "grammar", "spec": choice_as_grammar(value)}
    if name == "grammar":
        if not value.strip():
            raise invalid(field, "structured_outputs.grammar cannot be an empty string")
        return {"type": "grammar", "spec": value}
    raise invalid(field, "is not served by the low-latency pool")  # structural_tag: the gate sends it native first


def _response_format_plan(response_format: dict[str, Any] | None) -> StructuredPlan | None:
    """response_format json_schema / json_object; None for text; a 400 naming the field when malformed."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredPlan({"response_format": response_format}, {"type": "json_object", "spec": ""})
    if kind != "json_schema":
        raise invalid("response_format.type", f"{kind!r} is not served by the low-latency pool")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema", "must be an object with a 'schema' (type is json_schema)")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema", "must be a JSON schema object")
    return StructuredPlan({"response_format": response_format}, {"type": "json_schema", "spec": json.dumps(schema)},
                          "response_format.json_schema.schema")
