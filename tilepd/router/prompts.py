"""Prompt rendering with the model's own tokenizer and chat template.

The router sends token ids (not text) to prefill so that it knows the prompt length
before it leases a node, and so that the prompt the decode node continues is exactly
the one vLLM prefilled. Tokenisation follows vLLM's rules: completions add special
tokens, chat renders the template to text and tokenises it without adding them.

Both run in the render pool (render_pool.py), off the event loop and bounded in time and memory: a template's
cost follows the request. Clients never supply a template: `chat_template` is refused wherever it appears, and
`chat_template_kwargs` may only hold the keys the operator allows (`prompt_render.allowed_template_kwargs`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tilepd.contracts.service_configs import PromptRenderConfig
from tilepd.router.errors import invalid
from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest
from tilepd.router.render_pool import ChatJob, RenderLimits, RenderPool, TextJob
from tilepd.router.tools import ToolPlan, compile_job


def refuse_client_template(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """400 naming the field when a client brings a template, or a template kwarg the operator does not allow."""
    if "chat_template" in body:
        raise invalid("chat_template", "a client may not supply a chat template: the model's own is used")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "must be an object")
    for key in kwargs:
        if key == "chat_template":
            raise invalid("chat_template_kwargs.chat_template", "a client may not supply a chat template: the model's own is used")
        if key not in allowed:
            shown = ", ".join(allowed) if allowed else "none"
            raise invalid(f"chat_template_kwargs.{str(key)[:64]}", f"not an allowed template kwarg (allowed: {shown}; "
                          "the operator sets prompt_render.allowed_template_kwargs)")


class PromptRenderer:
    """Loads the tokenizer once (detokenising, tool parsing); renders requests to prompt token ids in the pool."""

    def __init__(self, tokenizer_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer_dir = Path(tokenizer_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.eos_token_ids = _eos_ids(self.tokenizer, tokenizer_dir)
        self.generation_defaults = _generation_defaults(tokenizer_dir)
        self.tools: Any = None  # a tilepd.router.tools.ToolCalling when the deployment names a tool parser
        self.pool: RenderPool | None = None

    def start_pool(self, cfg: PromptRenderConfig) -> None:
        """Start the render workers (at startup: a tokenizer that does not load in a worker fails the router here)."""
        self.pool = RenderPool(self.tokenizer, RenderLimits(cfg.workers, cfg.timeout_s, cfg.memory_mb))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def _pool(self) -> RenderPool:
        if self.pool is None:
            raise RuntimeError("PromptRenderer.start_pool was not called: no bounded renderer to render prompts in")
        return self.pool

    async def check_compiles(self, plan: ToolPlan, request_id: str) -> None:
        """400 naming the tool whose schema does not compile; compiled in the pool (a schema's cost is the client's)."""
        job = compile_job(plan)
        if job is None:
            return
        problem = await self._pool().render(job, request_id)
        if problem is not None:
            raise invalid(problem[0], problem[1])

    async def completion_ids(self, req: CompletionRequest, request_id: str) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list):
            if not prompt:
                raise invalid("prompt", "empty prompt")
            if isinstance(prompt[0], int):
                return list(prompt)  # type: ignore[arg-type]
            prompt = prompt[0]  # a one-element batch
            if isinstance(prompt, list):
                return list(prompt)
        if not prompt:
            raise invalid("prompt", "empty prompt")
        return await self._pool().render(TextJob(prompt, add_special_tokens=True), request_id)

    async def chat_ids(self, req: ChatCompletionRequest, request_id: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """tools: vLLM's tool dicts (`tool.model_dump()` of its parsed request), given to the template as vLLM does."""
        messages: list[dict[str, Any]] = []
        for msg in req.messages:
            content = msg.content
            if isinstance(content, list):  # text parts are joined like vLLM's "string" content format
                content = "\n".join(p.text or "" for p in content)
            messages.append({"role": msg.role, "content": content or "", **({"name": msg.name} if msg.name else {})})
        kwargs: dict[str, Any] = {
            **(req.chat_template_kwargs or {}),  # keys refuse_client_template allowed; the router's own win
            "add_generation_prompt": req.add_generation_prompt and not req.continue_final_message,
            "continue_final_message": req.continue_final_message,
            **({"tools": tools} if tools is not None else {}),
        }
        return await self._pool().render(ChatJob(messages, kwargs), request_id)


def _eos_ids(tokenizer: Any, tokenizer_dir: Path) -> frozenset[int]:
    """EOS ids as vLLM sees them: the tokenizer's plus generation_config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = _read_generation_config(tokenizer_dir)
    eos = gen.get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(e) for e in eos)
    return frozenset(ids)


def _generation_defaults(tokenizer_dir: Path) -> dict[str, Any]:
    """Sampling defaults vLLM takes from generation_config.json (its default `--generation-config auto`)."""
    gen = _read_generation_config(tokenizer_dir)
    return {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}


def _read_generation_config(tokenizer_dir: Path) -> dict[str, Any]:
    path = Path(tokenizer_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
