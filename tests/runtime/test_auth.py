"""Only the router may drive a decode node: the deployment secret, its derivations, and a real node that checks them.

A node started with `secret_file` answers 401 to a decode or cancel without the router's
bearer key or with a transfer token not minted from the secret, and stays idle; an admit on
its control port with an invented token is refused too. The router's own path (token from
the secret, bearer header) decodes as before.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import pytest

from tests.runtime.conftest import DecodeNode, start_node, stop_node
from tests.runtime.test_decode_server import PROMPTS, _fences, _handoff
from tests.runtime.hf_engine import hf_greedy
from tilepd import auth

SECRET = "a1" * 32


def _write_secret(path: Path, value: str = SECRET, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, mode)
    return path


def test_derivations_are_the_documented_hmacs() -> None:
    s = SECRET.encode()
    assert auth.transfer_token(s, "tx-1") == hmac.new(s, b"tilepd-transfer:tx-1", hashlib.sha256).hexdigest()
    assert auth.node_api_key(s) == hmac.new(s, b"tilepd-node-api", hashlib.sha256).hexdigest()
    assert auth.transfer_token_ok(s, "tx-1", auth.transfer_token(s, "tx-1"))
    assert not auth.transfer_token_ok(s, "tx-2", auth.transfer_token(s, "tx-1"))
    assert not auth.transfer_token_ok(b"b2" * 32, "tx-1", auth.transfer_token(s, "tx-1"))
    assert auth.bearer_ok(s, f"Bearer {auth.node_api_key(s)}") and auth.bearer_ok(s, f"bearer {auth.node_api_key(s)}")
    assert not auth.bearer_ok(s, None) and not auth.bearer_ok(s, auth.node_api_key(s)) and not auth.bearer_ok(s, "Bearer x")
    assert auth.node_auth_header(None) == {}
    assert len(auth.new_secret()) == 64 and auth.new_secret() != auth.new_secret()


def test_secret_file_is_refused_when_open_short_or_missing(tmp_path: Path) -> None:
    assert auth.load_secret(_write_secret(tmp_path / "ok")) == SECRET.encode()
    with pytest.raises(auth.SecretFileError, match=r"mode 0644 lets others read it; chmod 600"):
        auth.load_secret(_write_secret(tmp_path / "open", mode=0o644))
    with pytest.raises(auth.SecretFileError, match=r"holds 4 characters, at least 32"):
        auth.load_secret(_write_secret(tmp_path / "short", "abcd"))
    with pytest.raises(auth.SecretFileError, match=r"missing: No such file"):
        auth.load_secret(tmp_path / "missing")


def _start_node(python: str, weights: Path, tmp: Path, secret_file: Path) -> DecodeNode:
    return start_node(python, weights, tmp, secret_file=secret_file)


@pytest.mark.slow
def test_node_with_a_secret_refuses_strangers_and_serves_the_router(python_exe: str, tiny_llama: Path, hf_llama,
                                                                     tmp_path: Path) -> None:
    node = _start_node(python_exe, tiny_llama, tmp_path, _write_secret(tmp_path / "deployment.secret"))
    s = SECRET.encode()
    router = auth.node_auth_header(s)
    prompt = PROMPTS["short"]
    body = {"transfer_id": "tx-stranger", "token": "invented", "first_token": 5, "prompt_tokens": len(prompt), "max_tokens": 4,
            "stream": False, "kv_timeout_s": 30}
    try:
        with node.client() as c:
            def idle() -> bool:
                st = c.get("/status").json()
                return st["state"] == "free" and not st["busy"]

            # no credentials, a wrong key, the right key with an invented token: 401 each, the node stays idle
            for headers, b, code in [({}, body, "unauthorized"), ({"Authorization": "Bearer guessed"}, body, "unauthorized"),
                                     (router, body, "invalid_transfer_token"), ({}, {"transfer_id": "tx-stranger"}, "unauthorized")]:
                path = "/v1/decode" if "token" in b else "/v1/cancel"
                r = c.post(path, json=b, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == code, (path, headers, r.text)
                assert idle()
            # an admit on the control port with an invented token is refused: the slot stays free
            with pytest.raises(AssertionError, match="bad_token"):
                _handoff(node, hf_llama, prompt, "tx-stranger", token="invented", reserve=False)
            assert idle()
            # nor can anyone without the key, or with an invented token, reserve the slot
            held = {"transfer_id": "tx-stranger", "token": "invented", "holder": "stranger", "node_api": 2}
            for headers, code in [({}, "unauthorized"), (router, "invalid_transfer_token")]:
                r = c.post("/v1/reserve", json=held, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == code, r.text
                assert idle()
            # the router's way: token minted from the secret, bearer header -> HF's greedy tokens
            tid = "tx-router"
            first = _handoff(node, hf_llama, prompt, tid, token=auth.transfer_token(s, tid), headers=router)
            r = c.post("/v1/decode", headers=router, json={**body, "transfer_id": tid, "token": auth.transfer_token(s, tid),
                                                           "fence": _fences[tid], "first_token": first, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert [first] + r.json()["tokens"] == hf_greedy(hf_llama, prompt, 5)
            assert c.post("/v1/cancel", headers=router, json={"transfer_id": tid}).status_code == 200
            assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # read-only stays open
    finally:
        stop_node(node)
    text = node.log.read_text()
    assert "event=unauthorized" in text and "event=unauthenticated" not in text
    assert SECRET not in text and auth.node_api_key(s) not in text and auth.transfer_token(s, "tx-router") not in text
