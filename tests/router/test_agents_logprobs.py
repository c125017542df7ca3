"""logprobs / top_logprobs on the low-latency pool, through the router with the official `openai` client:
equal to a stock vLLM's for the same greedy request (the prefill vLLM with no marker is vLLM alone)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI

from .conftest import Stack
from .stack import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOL = 1e-4
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def client(plain_router: tuple[str, Any]) -> OpenAI:
    return OpenAI(base_url=plain_router[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def _vllm(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    assert stack.prefill is not None
    body = {"model": MODEL_NAME, "return_tokens_as_token_ids": False, **body}  # the prefill runs with them on: off, as stock
    r = httpx.post(stack.prefill.url + path, json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def _close(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    assert max(abs(a[k] - b[k]) for k in a) < TOL, (a, b)


def test_completions_logprobs_equal_vllm(client: OpenAI, router_stack: Stack) -> None:
    want = _vllm(router_stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3,
                                                   "ignore_eos": True})["choices"][0]
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                                      extra_body={"ignore_eos": True})
    assert raw.headers["x-tilepd-route"] == "low_latency"
    got = raw.parse().choices[0]
    assert got.text == want["text"]
    lp, ref = got.logprobs, want["logprobs"]
    assert lp is not None and lp.tokens == ref["tokens"] and lp.text_offset == ref["text_offset"]
    assert len(lp.tokens) == 12
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, ref["token_logprobs"])) < TOL
    for mine, theirs in zip(lp.top_logprobs, ref["top_logprobs"]):
        _close(mine, theirs)


def _chat_content(lp: Any) -> list[dict[str, Any]]:
    return [c.model_dump() for c in lp.content]


def test_chat_top_logprobs_equal_vllm_streamed_and_not(client: OpenAI, router_stack: Stack) -> None:
    kw = {"messages": CHAT, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    want = _vllm(router_stack, "/v1/chat/completions", kw)["choices"][0]
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, **kw)
    assert raw.headers["x-tilepd-route"] == "low_latency"
    got = raw.parse().choices[0]
    assert got.message.content == want["message"]["content"]
    mine, theirs = _chat_content(got.logprobs), want["logprobs"]["content"]
    assert len(mine) == len(theirs) == 10
    for m, t in zip(mine, theirs):
        assert (m["token"], m["bytes"]) == (t["token"], t["bytes"]) and abs(m["logprob"] - t["logprob"]) < TOL
        assert [x["token"] for x in m["top_logprobs"]] == [x["token"] for x in t["top_logprobs"]]
        assert [x["bytes"] for x in m["top_logprobs"]] == [x["bytes"] for x in t["top_logprobs"]]
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(m["top_logprobs"], t["top_logprobs"])) < TOL
    streamed: list[dict[str, Any]] = []
    text = ""
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += _chat_content(chunk.choices[0].logprobs)
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == got.message.content
    assert [s["token"] for s in streamed] == [m["token"] for m in mine]
    assert max(abs(s["logprob"] - m["logprob"]) for s, m in zip(streamed, mine)) < TOL


def test_token_strings_are_vllms(router_stack: Stack) -> None:
    from transformers import AutoTokenizer
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    from tilepd.router.logprobs import token_strings

    tok = AutoTokenizer.from_pretrained(router_stack.model)
    ids = list(range(0, min(tok.vocab_size, 3000), 7))
    assert token_strings(tok, ids) == convert_ids_list_to_tokens(tok, ids)


def test_gate_sends_logprobs_only_to_nodes_that_declare_them() -> None:
    from tilepd.router.gate import gate
    from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest

    old = {"temperature": True, "logprobs": False}
    new = {"temperature": True, "logprobs": True, "top_logprobs": True, "top_logprobs_max": 5}
    comp = CompletionRequest(prompt="x", logprobs=3)
    assert gate(comp, old).param == "logprobs" and gate(comp, new) is None
    assert gate(CompletionRequest(prompt="x", logprobs=6), new).param == "logprobs"
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3)
    assert gate(chat, old).param == "logprobs" and gate(chat, new) is None
    assert gate(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=3), new).param == "top_logprobs"
