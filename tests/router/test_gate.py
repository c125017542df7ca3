"""The capability gate names the first parameter the low-latency engine cannot honour."""

from __future__ import annotations

from typing import Any

import pytest

from tilepd.router.gate import gate
from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest

FULL_CAPS = {"temperature": True, "top_p": True, "top_k": True, "seed": True, "stop_token_ids": True, "ignore_eos": True,
             "max_tokens": True, "logprobs": False, "n": False, "presence_penalty": False, "frequency_penalty": False,
             "repetition_penalty": False}


def _cmpl(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **kw})


def _chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize("kw", [
    {}, {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 1}, {"stop": ["a", "b"], "include_stop_str_in_output": True},
    {"stop_token_ids": [3]}, {"ignore_eos": True}, {"max_tokens": 5, "user": "u", "stream": True,
                                                     "stream_options": {"include_usage": True}},
    {"presence_penalty": 0.0, "frequency_penalty": 0, "repetition_penalty": 1.0, "logit_bias": {}, "min_tokens": 0,
     "spaces_between_special_tokens": True, "metadata": {"a": 1}},
    {"prompt": [[1, 2, 3]]}, {"prompt": [1, 2, 3]},
])
def test_supported_completions_pass(kw: dict[str, Any]) -> None:
    assert gate(_cmpl(**kw), FULL_CAPS) is None


@pytest.mark.parametrize("kw,param", [
    ({"n": 2}, "n"), ({"best_of": 3}, "best_of"), ({"logprobs": 1}, "logprobs"), ({"echo": True}, "echo"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 0.1}, "frequency_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"), ({"min_tokens": 3}, "min_tokens"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"prompt": ["a", "b"]}, "prompt"), ({"suffix": "x"}, "suffix"),
])
def test_unsupported_completions_name_the_parameter(kw: dict[str, Any], param: str) -> None:
    refusal = gate(_cmpl(**kw), FULL_CAPS)
    assert refusal is not None and refusal.param == param


@pytest.mark.parametrize("kw,param", [
    ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2, "logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
])
def test_unsupported_chat_names_the_parameter(kw: dict[str, Any], param: str) -> None:
    refusal = gate(_chat(**kw), FULL_CAPS)
    assert refusal is not None and refusal.param == param


def test_chat_text_parts_and_text_response_format_pass() -> None:
    req = _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}], response_format={"type": "text"},
                tool_choice="none", max_completion_tokens=3)
    assert gate(req, FULL_CAPS) is None


def test_the_engine_capabilities_decide() -> None:
    lacking = {**FULL_CAPS, "top_k": False, "seed": False}
    assert gate(_cmpl(top_k=5), lacking).param == "top_k"  # type: ignore[union-attr]
    assert gate(_cmpl(seed=5), lacking).param == "seed"  # type: ignore[union-attr]
    assert gate(_cmpl(top_k=-1), lacking) is None  # -1 means "off" in vLLM
    richer = {**FULL_CAPS, "logprobs": True, "top_logprobs_max": 2, "presence_penalty": True}
    assert gate(_cmpl(logprobs=2, presence_penalty=0.3), richer) is None
    assert gate(_cmpl(logprobs=3), richer).param == "logprobs"  # type: ignore[union-attr]  # beyond top_logprobs_max
