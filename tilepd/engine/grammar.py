"""Grammar-constrained decoding with xgrammar, compiled as vLLM's xgrammar backend compiles it (v0.32).

The node compiles the request's constraint against the model's tokenizer (vocab size from the model
config, like vLLM's `model_config.get_vocab_size()`), keeps one GrammarMatcher per request, advances it
by the first token (sampled by the prefill vLLM under the same constraint), and before each later
sampling fills the token bitmask and applies it to the float32 logits in place (CPU or CUDA tensors).
The matcher's stop tokens are vLLM's `all_stop_token_ids`: the model's EOS ids plus the request's.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# what the node compiles; vLLM's names (StructuredOutputOptions) for the same constraints
# ("structural_tag": what vLLM's tool parsers build for tool_choice required/named/auto)
KINDS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")


class GrammarError(ValueError):
    """A constraint that does not compile; `field` names the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _xgr() -> Any:
    import xgrammar

    return xgrammar


@dataclass(frozen=True)
class Constraint:
    """kind (one of KINDS) and its text: a JSON schema, a regex, an EBNF/Lark grammar, an xgrammar structural tag
    (JSON, vLLM's `structural_tag` string), or "" for json_object."""

    kind: str
    spec: str


# the compile cache's bound: xgrammar evicts least-recently-used grammars past it. Unbounded, every distinct schema a
# client sends stays compiled in the node for good (each a token mask table: up to megabytes)
CACHE_LIMIT_BYTES = 256 << 20


class GrammarCompiler:
    """One per node: the tokenizer's xgrammar info and a compile cache (schemas repeat across agent calls), LRU by bytes."""

    def __init__(self, info: Any, vocab_size: int, cache_limit_bytes: int = CACHE_LIMIT_BYTES) -> None:
        """info: an xgrammar.TokenizerInfo (from_pretrained builds it from a tokenizer directory)."""
        self.vocab_size = int(vocab_size)
        self.info = info
        self.compiler = _xgr().GrammarCompiler(info, max_threads=8, cache_enabled=True, cache_limit_bytes=int(cache_limit_bytes))
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, tokenizer_dir: Path, vocab_size: int, cache_limit_bytes: int = CACHE_LIMIT_BYTES) -> "GrammarCompiler":
        """The model's HF tokenizer, padded to the model config's vocab_size as vLLM pads it."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        return cls(_xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=int(vocab_size)), vocab_size, cache_limit_bytes)

    @property
    def cache_bytes(self) -> int:
        return int(self.compiler.get_cache_size_bytes())

    def compile(self, c: Constraint, field: str = "structured_output") -> Any:
        """-> xgrammar.CompiledGrammar; GrammarError naming `field`.spec when the constraint is malformed."""
        _xgr()  # import xgrammar first: a node without it fails here, before the constraint is parsed
        if c.kind not in KINDS:
            raise GrammarError(f"{field}.type", f"{c.kind!r} is not one of {', '.join(KINDS)}")
        if c.kind in ("json_schema", "structural_tag"):
            try:
                json.loads(c.spec)
            except ValueError as exc:
                raise GrammarError(f"{field}.spec", f"the {c.kind} spec is not JSON: {exc}") from None
        try:
            with self._lock:
                if c.kind == "json_schema":
                    return self.compiler.compile_json_schema(c.spec, any_whitespace=True)
                if c.kind == "json_object":
                    return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
                if c.kind == "regex":
                    return self.compiler.compile_regex(c.spec)
                if c.kind == "structural_tag":
                    return self._structural_tag(c.spec)
                return self.compiler.compile_grammar(c.spec)  # EBNF (GBNF) as xgrammar reads it
        except (ValueError, RuntimeError, TypeError, KeyError) as exc:
            raise GrammarError(f"{field}.spec", f"{c.kind} does not compile: {exc}") from None

    def _structural_tag(self, spec: str) -> Any:
        """As vLLM's xgrammar backend: the legacy {"structures", "triggers"} form, else xgrammar's own format."""
        xgr = _xgr()
        tag = json.loads(spec)
        if isinstance(tag, dict) and "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]) for s in tag["structures"]]
            return self.compiler.compile_structural_tag(items, tag["triggers"])
        return self.compiler.compile_structural_tag(spec)

    def matcher(self, compiled: Any, stop_token_ids: set[int]) -> "GrammarState":
        return GrammarState(compiled, sorted(stop_token_ids), self.vocab_size)


class GrammarState:
    """One request's matcher and its token bitmask (the bitmask moves to the logits' device once)."""

    def __init__(self, compiled: Any, stop_token_ids: list[int], vocab_size: int) -> None:
        xgr = _xgr()
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._device_mask: torch.Tensor | None = None

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it (nothing changes then)."""
        return bool(self.matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def mask(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits [V] (float32) become -inf, in place."""
        xgr = _xgr()
        self.matcher.fill_next_token_bitmask(self.bitmask)
        mask = self.bitmask
        if logits.device.type != "cpu":
            if self._device_mask is None:
                self._device_mask = torch.empty_like(self.bitmask, device=logits.device)
            self._device_mask.copy_(self.bitmask, non_blocking=True)
            mask = self._device_mask
        xgr.apply_token_bitmask_inplace(logits.view(1, -1), mask, vocab_size=logits.shape[-1])
