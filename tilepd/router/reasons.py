"""Route reasons that become a Prometheus label, a response header and a log field: bounded to names the router knows.

A refusal names the parameter it refuses (`unsupported:<param>`), and for an unknown field that name is the
client's own JSON key: as a label, every new key would be a new time series (unbounded cardinality), and as a
header a non-latin-1 key cannot be encoded (a 500). A parameter outside the request models' declared fields is
`unsupported:other` there; the error body still names the client's key exactly (JSON carries any text).
"""

from __future__ import annotations

import re

from tilepd.router.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StructuredOutputs, TextPart

UNSUPPORTED = "unsupported:"
OTHER = "other"
_INDEX = re.compile(r"\[\d+\]")
# request fields of vLLM 0.32's chat and completions models that the router's models leave undeclared, and the
# guided_* fields older vLLMs took: names a client means as vLLM parameters, worth their own label
VLLM_FIELDS = frozenset({
    "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt", "chat_template", "documents", "ec_transfer_params",
    "include_reasoning", "length_penalty", "logit_bias", "logprob_token_ids", "media_io_kwargs", "min_p", "min_tokens",
    "mm_payload", "mm_processor_kwargs", "parallel_tool_calls", "priority", "prompt_embeds", "prompt_logprobs",
    "reasoning_effort", "repetition_detection", "request_id", "return_mm_kwargs", "return_prompt_text", "return_token_ids",
    "return_token_offsets", "return_tokens_as_token_ids", "routed_experts_prompt_start", "session_id",
    "spaces_between_special_tokens", "stream_interval", "thinking_token_budget", "truncate_prompt_tokens", "truncation_side",
    "use_beam_search", "vllm_xargs", "watermarking",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
})
_KNOWN = frozenset({*ChatCompletionRequest.model_fields, *CompletionRequest.model_fields, *ChatMessage.model_fields,
                    *TextPart.model_fields, *(f.alias or n for n, f in StructuredOutputs.model_fields.items()), *VLLM_FIELDS})


def bounded_reason(reason: str) -> str:
    """`unsupported:<param>` kept when every part of the param is a declared field name (list indices dropped), else
    `unsupported:other`; any other reason is the router's own word and is kept."""
    if not reason.startswith(UNSUPPORTED):
        return reason
    param = _INDEX.sub("", reason[len(UNSUPPORTED):])
    parts = param.split(".")
    if param and all(p in _KNOWN for p in parts):
        return UNSUPPORTED + param
    return UNSUPPORTED + OTHER
