"""Structured output (`response_format`) on the low-latency path.

The same constraint goes twice: to the prefill vLLM as the client's own `response_format` (vLLM turns it
into its structured-output request exactly as for a direct call, so the first token obeys it), and to the
decode node as {"type", "spec"} (tilepd.engine.grammar), whose matcher starts after that first token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tilepd.router.errors import invalid


@dataclass(frozen=True)
class StructuredPlan:
    prefill: dict[str, Any]  # fields merged into the prefill request
    node: dict[str, str]  # the decode node's `structured_output`
    field: str = "response_format"  # named in the 400 when the prefill vLLM refuses the constraint


def structured_plan(response_format: dict[str, Any] | None) -> StructuredPlan | None:
    """None for plain text; a 400 naming the field when the response_format is malformed."""
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
