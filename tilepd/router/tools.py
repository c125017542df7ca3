"""Tool calls (`tools` + `tool_choice`) on the low-latency path, with vLLM's own request model and tool parser.

Nothing here re-implements vLLM: the request is validated by vLLM's `ChatCompletionRequest` (its 400s,
with the parameter they name), the parser is the one vLLM's `--tool-call-parser NAME` selects
(`ParserManager`), its `adjust_request` turns `required` / a named function / `auto` into the
structured-output request vLLM would sample under (a JSON schema or an xgrammar structural tag), and its
`parse` / `parse_delta` turn the text into `tool_calls`, as `OpenAIServingChat` does. The router only
carries that constraint twice (to the prefill, which samples the first token under it, and to the decode
node's grammar) and writes the answers in vLLM's shapes.

vLLM (and torch under it) is imported when the router starts with a `tool_call_parser`, not per request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tilepd.router.errors import invalid
from tilepd.router.structured import NODE_KIND, StructuredPlan, constraint_fields, options_set

# the structured-output fields vLLM's tool parsers set (adjust_request) that this path carries to the node
TOOL_FIELDS = ("json", "structural_tag")


class ToolCalling:
    """The deployment's tool parser (vLLM's `--tool-call-parser` with `--enable-auto-tool-choice`), loaded once."""

    def __init__(self, parser_name: str, tokenizer: Any, model_name: str) -> None:
        from vllm.parser.parser_manager import ParserManager

        self.parser_name = parser_name
        self.tokenizer = tokenizer
        try:
            self.parser_cls = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True,
                                                       model_name=model_name, tokenizer=tokenizer)
        except (KeyError, ValueError, TypeError, ImportError) as exc:
            raise ValueError(f"tool_call_parser {parser_name!r}: vLLM cannot build it for this tokenizer: {exc}") from exc
        if self.parser_cls is None or self.parser_cls.tool_parser_cls is None:
            raise ValueError(f"tool_call_parser {parser_name!r} is not a vLLM tool parser")

    def plan(self, body: dict[str, Any]) -> "ToolPlan":
        """vLLM's view of the request; a 400 naming the field when vLLM (or the constraint) refuses it."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMClientError

        try:
            vreq = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
            param = param or _vllm_param(first.get("ctx", {}).get("error"), "tools")
            raise invalid(param, str(first["msg"])) from None
        except (ValueError, VLLMClientError) as exc:  # vLLM's model validators raise VLLMValidationError (parameter=...)
            raise invalid(_vllm_param(exc, "tools"), str(exc)) from None
        parser = self.parser_cls(self.tokenizer, vreq.tools, chat_template_kwargs=vreq.chat_template_kwargs or {}, model_config=None)
        if vreq.tool_choice != "none":  # OnlineRenderer.preprocess_chat: no adjust_request for "none"
            try:
                vreq = parser.adjust_request(vreq)
            except (ValueError, VLLMClientError) as exc:
                raise invalid(_vllm_param(exc, "tool_choice"), str(exc)) from None
        structured = _constraint(vreq)
        return ToolPlan(request=vreq, parser=parser, tool_dicts=[t.model_dump() for t in vreq.tools or ()],
                        structured=structured, skip_special_tokens=bool(vreq.skip_special_tokens))


def _vllm_param(exc: Any, default: str) -> str:
    return str(getattr(exc, "parameter", None) or default)


class Unsupported(Exception):
    """The low-latency engine cannot take this tool request: the router routes it to the native pool or refuses it."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(reason)
        self.param = param
        self.reason = reason


def _constraint(vreq: Any) -> StructuredPlan | None:
    """The structured-output request vLLM's parser set for this tool_choice, as the prefill and the node take it."""
    so = vreq.structured_outputs
    if so is None:
        return None
    used = constraint_fields(so)
    if len(used) != 1 or next(iter(used)) not in TOOL_FIELDS:
        raise Unsupported("tool_choice", f"the tool parser asked for a {'/'.join(used) or 'empty'} constraint, which the "
                                         "low-latency engine does not compile")
    if options_set(so):
        raise Unsupported("tool_choice", "the tool parser's constraint changes JSON whitespace/properties rules the decode "
                                         "node does not compile")
    name, value = next(iter(used.items()))
    spec = value if isinstance(value, str) else json.dumps(value)
    return StructuredPlan({"structured_outputs": {name: value}}, {"type": NODE_KIND[name], "spec": spec}, "tools")


@dataclass(frozen=True)
class CompileJob:
    """A tool-call constraint to compile in the render pool (its cost follows the client's schemas)."""

    kind: str
    spec: str
    tool_params: tuple[str | None, ...]  # each tool's parameters schema as JSON, to name the one that does not compile


def compile_job(plan: "ToolPlan") -> CompileJob | None:
    if plan.structured is None:
        return None
    params = tuple(json.dumps(t.function.parameters) if t.function.parameters is not None else None for t in plan.request.tools or ())
    return CompileJob(plan.structured.node["type"], plan.structured.node["spec"], params)


def compile_problem(job: CompileJob) -> tuple[str, str] | None:
    """Compile the constraint's grammar (no tokenizer needed): None, or the (param, message) of the 400 naming the tool."""
    import xgrammar as xgr

    kind, spec = job.kind, job.spec

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(spec, any_whitespace=True)
        else:
            tag = json.loads(spec)
            if isinstance(tag, dict) and "structures" in tag:  # vLLM's legacy form (backend_xgrammar.validate_xgrammar_grammar)
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]) for s in tag["structures"]]
                xgr.Grammar.from_structural_tag(items, tag["triggers"])
            else:
                xgr.Grammar.from_structural_tag(spec)
        return None
    except (ValueError, RuntimeError, TypeError, KeyError) as exc:
        whole = str(exc)
    for i, params in enumerate(job.tool_params):
        if params is None:
            continue
        try:
            xgr.Grammar.from_json_schema(params, any_whitespace=True)
        except (ValueError, RuntimeError, TypeError) as exc:
            return f"tools[{i}].function.parameters", f"the JSON schema does not compile: {exc}"[:1000]
    return "tools", f"the tool-call constraint does not compile: {whole}"[:1000]


@dataclass
class ToolPlan:
    """One request's tools: vLLM's adjusted request, its parser, what the template renders, the constraint."""

    request: Any  # vllm ChatCompletionRequest after the parser's adjust_request
    parser: Any  # vllm Parser, one per request (it holds the stream state)
    tool_dicts: list[dict[str, Any]]
    structured: StructuredPlan | None
    skip_special_tokens: bool
    tools_streamed: bool = field(default=False)

    @property
    def choice(self) -> Any:
        return self.request.tool_choice

    @property
    def named(self) -> str | None:
        tc = self.request.tool_choice
        return None if isinstance(tc, str) or tc is None else str(tc.function.name)

    def message(self, text: str, token_ids: list[int], prompt_ids: list[int], finish_reason: str) -> tuple[dict[str, Any], str]:
        """The non-streamed message and finish_reason, as OpenAIServingChat.chat_completion_full_generator builds them."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseChoice, ChatMessage
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
        from vllm.renderers.chat_utils import make_tool_call_id

        req = self.request
        self.parser.set_prompt_token_ids(prompt_ids)
        reasoning, content, tool_calls = self.parser.parse(text, req, enable_auto_tools=True, model_output_token_ids=token_ids)
        named_or_required = self.named is not None or req.tool_choice == "required"
        auto_called = False
        if named_or_required:
            message = ChatMessage(role="assistant", reasoning=reasoning, content=content or "",
                                  tool_calls=[ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in (tool_calls or [])])
        elif req.tool_choice == "auto" and tool_calls:
            auto_called = True
            message = ChatMessage(role="assistant", reasoning=reasoning, content=content,
                                  tool_calls=[ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in tool_calls])
        else:
            message = ChatMessage(role="assistant", reasoning=reasoning, content=content)
        # "tool_calls" for auto and required calls, "stop" for a named one (OpenAI's rule, as vLLM applies it)
        if auto_called or (req.tool_choice == "required" and finish_reason == "stop"):
            finish_reason = "tool_calls"
        choice = maybe_filter_parallel_tool_calls(
            ChatCompletionResponseChoice(index=0, message=message, finish_reason=finish_reason), req)
        return choice.message.model_dump(mode="json"), finish_reason

    def delta(self, text: str, token_ids: list[int], prompt_ids: list[int], finished: bool) -> dict[str, Any] | None:
        """One streamed delta as OpenAIServingChat.chat_completion_stream_generator builds it; None: nothing to send yet."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseStreamChoice
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

        msg = self.parser.parse_delta(delta_text=text, delta_token_ids=list(token_ids), request=self.request,
                                      prompt_token_ids=prompt_ids, finished=finished)
        if msg is None:
            return None
        if msg.tool_calls:
            self.tools_streamed = True
        choice = maybe_filter_parallel_tool_calls(ChatCompletionResponseStreamChoice(index=0, delta=msg), self.request)
        return choice.delta.model_dump(mode="json", exclude_unset=True)

    def stream_finish_reason(self, finish_reason: str) -> str:
        """vLLM's streamed rule: "tool_calls" once tool calls were streamed, unless a named function was forced."""
        if self.tools_streamed and self.named is None and finish_reason == "stop":
            return "tool_calls"
        return finish_reason
