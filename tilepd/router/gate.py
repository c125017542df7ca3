"""The capability gate: which requests the low-latency (batch=1) engine can honour.

A request the engine cannot serve exactly as asked must never be served silently
differently: it goes to the native vLLM pool when one exists, else it gets a typed
error naming the parameter. The engine says what it supports in the decode node's
`/capabilities` (`sampling`), so a newer engine widens the gate without a router change.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Collection
from typing import Any

from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest, StructuredOutputs
from tilepd.router.structured import NODE_KIND, RESPONSE_FORMAT_FIELD, constraint_fields, is_lark, options_set, requested_fields

# extra (undeclared) fields that never change the output
HARMLESS_EXTRAS = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls", "request_id", "priority"})
# extra fields whose vLLM default is truthy: that default value is harmless too
TRUTHY_DEFAULTS: dict[str, Any] = {"spaces_between_special_tokens": True, "length_penalty": 1.0}


@dataclass(frozen=True)
class Refusal:
    """Why the low-latency pool cannot take a request: the parameter and a reason for people."""

    param: str
    reason: str


def _lacks(caps: dict[str, Any], name: str) -> bool:
    return not bool(caps.get(name, False))


def gate(req: CompletionRequest | ChatCompletionRequest, caps: dict[str, Any], *, tool_parser: bool = False) -> Refusal | None:
    """Return the first parameter the engine cannot honour, or None when it can take the request.

    tool_parser: the router has the deployment's vLLM tool parser (tilepd.router.tools); without it, any
    `tools` go to the native pool. The constraint a tool_choice needs is checked against the node's
    `structured_output` kinds once vLLM's parser has built it (app._tool_plan)."""
    if req.n > 1:
        return Refusal("n", "the low-latency engine returns one choice per request")
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and req.best_of > 1:
            return Refusal("best_of", "the low-latency engine samples one sequence")
        if req.logprobs is not None and (_lacks(caps, "logprobs") or req.logprobs > int(caps.get("top_logprobs_max", 0))):
            return Refusal("logprobs", f"the engine does not return {req.logprobs} logprobs per token")
        if req.echo:
            return Refusal("echo", "echo is served by the native pool only")
        if req.suffix:
            return Refusal("suffix", "suffix is not supported")
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) and len(req.prompt) > 1:
            return Refusal("prompt", "a batch of prompts needs several sequences")
    else:
        if req.top_logprobs and not req.logprobs:  # vLLM answers this with a 400: let the native pool say so
            return Refusal("top_logprobs", "top_logprobs needs logprobs: true")
        if req.logprobs and (_lacks(caps, "logprobs") or (req.top_logprobs or 0) > int(caps.get("top_logprobs_max", 0))):
            return Refusal("logprobs", f"the engine does not return {req.top_logprobs or 0} top logprobs per token")
        if (req.tools or req.tool_choice not in (None, "none")) and not tool_parser:
            return Refusal("tools" if req.tools else "tool_choice", "this router has no tool_call_parser: tool calling is served "
                           "by the native pool only")
        for i, msg in enumerate(req.messages):
            if isinstance(msg.content, list) and any(p.type != "text" for p in msg.content):
                return Refusal(f"messages[{i}].content", "only text content parts are supported")
            for key, value in (msg.model_extra or {}).items():  # tool_calls, tool_call_id, ...: the router's template call drops them
                if value not in (None, []):
                    return Refusal(f"messages[{i}].{key}", "the low-latency pool renders role, content and name only")
    refusal = _gate_structured(req, caps) or _gate_sampling(req, caps)
    if refusal is not None:
        return refusal
    return _gate_extras(req)


def _gate_structured(req: CompletionRequest | ChatCompletionRequest, caps: dict[str, Any]) -> Refusal | None:
    """response_format and structured_outputs: the node must compile the one constraint they ask for, as vLLM's xgrammar
    backend would. Anything else (options, several kinds, structural tags, Lark) goes native, where vLLM answers it."""
    kinds = caps.get("structured_output") or ()
    rf_type = (req.response_format or {}).get("type", "text")
    if rf_type != "text" and (rf_type not in RESPONSE_FORMAT_FIELD or rf_type not in kinds):
        return Refusal("response_format", f"the engine does not decode under a {rf_type!r} response_format")
    if req.structured_outputs is None:
        return None
    return _gate_structured_outputs(req, req.structured_outputs, kinds)


def _gate_structured_outputs(req: CompletionRequest | ChatCompletionRequest, so: StructuredOutputs,
                             kinds: Collection[str]) -> Refusal | None:
    """Refused by name, never dropped: unknown fields, non-default options, tools alongside, several kinds, and the kinds
    the node does not compile as vLLM does (structural_tag via this field, Lark grammars, kinds missing from `kinds`)."""
    extra = next(iter(so.model_extra or {}), None)
    if extra is not None:
        return Refusal(f"structured_outputs.{extra}", "not a structured_outputs field of vLLM 0.32")
    option = next(iter(options_set(so)), None)
    if option is not None:
        return Refusal(f"structured_outputs.{option}", "the decode node compiles constraints with this option's default only")
    if isinstance(req, ChatCompletionRequest) and (req.tools or req.tool_choice is not None):
        return Refusal("structured_outputs", "with tools, vLLM's tool parser owns the constraint: served by the native pool")
    if len(requested_fields(req)) > 1:
        return Refusal("structured_outputs", "several constraint kinds at once (vLLM refuses them): served by the native pool")
    for name, value in constraint_fields(so).items():
        if name == "structural_tag":
            return Refusal("structured_outputs.structural_tag", "structural tags are served by the native pool")
        if name == "grammar" and value.strip() and is_lark(value):  # a blank grammar is vLLM's 400 (structured_plan)
            return Refusal("structured_outputs.grammar", "a Lark grammar (no '::=' rule): the decode node compiles EBNF only")
        if NODE_KIND[name] not in kinds:
            return Refusal(f"structured_outputs.{name}", f"the engine does not decode under a {NODE_KIND[name]!r} constraint")
    return None


def _gate_sampling(req: CompletionRequest | ChatCompletionRequest, caps: dict[str, Any]) -> Refusal | None:
    wanted: list[tuple[str, bool]] = [
        ("temperature", req.temperature is not None and req.temperature > 0),
        ("top_p", req.top_p is not None and req.top_p < 1),
        ("top_k", req.top_k is not None and req.top_k > 0),
        ("seed", req.seed is not None),
        ("stop_token_ids", bool(req.stop_token_ids)),
        ("ignore_eos", req.ignore_eos),
        ("presence_penalty", bool(req.presence_penalty)),
        ("frequency_penalty", bool(req.frequency_penalty)),
        ("repetition_penalty", req.repetition_penalty not in (None, 1.0)),
    ]
    for name, used in wanted:
        if used and _lacks(caps, name):
            return Refusal(name, f"the engine does not implement {name}")
    return None


def _gate_extras(req: CompletionRequest | ChatCompletionRequest) -> Refusal | None:
    for name, value in (req.model_extra or {}).items():
        if name in HARMLESS_EXTRAS or not value:
            continue
        if name in TRUTHY_DEFAULTS and value == TRUTHY_DEFAULTS[name]:
            continue
        return Refusal(name, "the low-latency pool does not implement this parameter")
    return None
