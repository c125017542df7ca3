"""Prompt rendering with the model's own tokenizer and chat template.

The router sends token ids (not text) to prefill so that it knows the prompt length
before it leases a node, and so that the prompt the decode node continues is exactly
the one vLLM prefilled. Tokenisation follows vLLM's rules: completions add special
tokens, chat renders the template to text and tokenises it without adding them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tilepd.router.errors import invalid
from tilepd.router.protocol import ChatCompletionRequest, CompletionRequest


class PromptRenderer:
    """Loads the tokenizer once; renders requests to prompt token ids."""

    def __init__(self, tokenizer_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.eos_token_ids = _eos_ids(self.tokenizer, tokenizer_dir)
        self.generation_defaults = _generation_defaults(tokenizer_dir)
        self.tools: Any = None  # a tilepd.router.tools.ToolCalling when the deployment names a tool parser

    def completion_ids(self, req: CompletionRequest) -> list[int]:
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
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def chat_ids(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """tools: vLLM's tool dicts (`tool.model_dump()` of its parsed request), given to the template as vLLM does."""
        messages: list[dict[str, Any]] = []
        for msg in req.messages:
            content = msg.content
            if isinstance(content, list):  # text parts are joined like vLLM's "string" content format
                content = "\n".join(p.text or "" for p in content)
            messages.append({"role": msg.role, "content": content or "", **({"name": msg.name} if msg.name else {})})
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                **({"tools": tools} if tools is not None else {}),
                **(req.chat_template_kwargs or {}),
            )
        except Exception as exc:  # the template raised: the messages do not fit it
            raise invalid("messages", f"the chat template rejected them: {exc}") from exc
        return list(self.tokenizer.encode(text, add_special_tokens=False))


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
