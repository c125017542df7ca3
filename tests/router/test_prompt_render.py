"""A chat template cannot freeze or kill the router (issue 26): clients bring no template, and the operator's own
renders in bounded workers (tilepd/router/render_pool.py), on the real router process.

The expensive template is the operator's (a test copy of the model's tokenizer with loops and a string whose size
follow two kwargs the test config allows): what a client can reach through an allowed kwarg or its messages."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tilepd.contracts.service_configs import PromptRenderConfig

from .conftest import Stack
from .stack import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# nested loops of up to 10^10 steps (Jinja's sandbox allows range(100000)), and a string of `grow` bytes
BOMB = ("{% for i in range(repeat | default(0)) %}{% for j in range(repeat | default(0)) %}{% endfor %}{% endfor %}"
        "{% if grow is defined %}{{ ('x' * grow) | length }}{% endif %}")
TIMEOUT_S = 20.0  # long enough that plain requests sent during one overrun are served before it ends, on a loaded box
MEMORY_MB = 256
PLAIN = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def bomb_router(router_stack: Stack, start_router_proc: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    tok_dir = tmp_path_factory.mktemp("operator-template")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        shutil.copy(router_stack.model / name, tok_dir / name)
    cfg_path = tok_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    template = BOMB + (router_stack.model / "chat_template.jinja").read_text()
    tok_cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(tok_cfg))
    (tok_dir / "chat_template.jinja").write_text(template)
    limits = PromptRenderConfig(allowed_template_kwargs=("repeat", "grow"), workers=2, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    srv, _ = start_router_proc(router_stack.config(native=False, tokenizer_dir=tok_dir, prompt_render=limits))
    return srv.url


def _error(r: httpx.Response) -> tuple[int, str | None, str | None, str]:
    err = r.json()["error"]
    return r.status_code, err["code"], err["param"], err["message"]


def test_a_client_cannot_bring_a_template_or_an_unlisted_kwarg(bomb_router: str) -> None:
    url = bomb_router + "/v1/chat/completions"
    own = "{% for m in messages %}{{ m.content }}{% endfor %}"
    status, _, param, message = _error(httpx.post(url, json={**CHAT, "chat_template_kwargs": {"chat_template": own}}, timeout=30))
    assert (status, param) == (400, "chat_template_kwargs.chat_template") and "may not supply a chat template" in message
    status, _, param, _ = _error(httpx.post(url, json={**CHAT, "chat_template": own}, timeout=30))
    assert (status, param) == (400, "chat_template")
    status, _, param, message = _error(httpx.post(url, json={**CHAT, "chat_template_kwargs": {"tokenize": True}}, timeout=30))
    assert (status, param) == (400, "chat_template_kwargs.tokenize") and "allowed: repeat, grow" in message
    ok = httpx.post(url, json={**CHAT, "chat_template_kwargs": {"repeat": 3}}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text


def test_a_template_bomb_gets_a_400_while_the_router_serves_others(bomb_router: str) -> None:
    """The bomb runs for TIMEOUT_S in a worker; plain completions sent a second later are all answered before it is
    (an order, not a speed: the old router rendered on its event loop and answered nothing until the bomb ended,
    which with 10^10 loop steps is never)."""
    answered: dict[str, Any] = {}

    def bomb() -> None:
        t0 = time.monotonic()
        r = httpx.post(bomb_router + "/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"repeat": 100000}},
                       timeout=TIMEOUT_S + 60)
        answered["bomb"] = (time.monotonic(), time.monotonic() - t0, r)

    thread = threading.Thread(target=bomb)
    thread.start()
    time.sleep(1.0)
    plain_done: list[tuple[float, int]] = []
    with httpx.Client(timeout=TIMEOUT_S + 60) as client:
        for i in range(3):
            r = client.post(bomb_router + "/v1/completions", json={**PLAIN, "prompt": f"request {i}"})
            plain_done.append((time.monotonic(), r.status_code))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    thread.join(TIMEOUT_S + 90)
    bomb_at, bomb_s, bomb_r = answered["bomb"]
    assert all(at < bomb_at for at, _ in plain_done), (plain_done, bomb_at)
    status, code, param, message = _error(bomb_r)
    assert (status, code, param) == (400, "prompt_render_limit", "messages"), message
    assert f"over {TIMEOUT_S:g} s (prompt_render.timeout_s)" in message
    assert TIMEOUT_S <= bomb_s < TIMEOUT_S + 30, bomb_s
    # the overrun worker was replaced: the router renders chats again
    again = httpx.post(bomb_router + "/v1/chat/completions", json=CHAT, timeout=60)
    assert again.status_code == 200, again.text


def test_a_huge_string_in_the_template_gets_a_400_and_the_router_lives(bomb_router: str) -> None:
    r = httpx.post(bomb_router + "/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"grow": 8 << 30}}, timeout=60)
    status, code, param, message = _error(r)
    assert (status, code, param) == (400, "prompt_render_limit", "messages")
    assert f"over {MEMORY_MB} MiB (prompt_render.memory_mb)" in message
    assert httpx.get(bomb_router + "/health", timeout=10).status_code == 200
    again = httpx.post(bomb_router + "/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"grow": 10}}, timeout=60)
    assert again.status_code == 200, again.text


def test_the_router_log_names_each_limit(bomb_router: str, router_stack: Stack) -> None:
    logs = "".join(p.read_text() for p in Path(router_stack.workdir).glob("router-*.log"))
    assert "event=render_limit limit=timeout_s" in logs and "event=render_limit limit=memory_mb" in logs
    assert "event=render_worker_started" in logs
