"""Logprobs on the low-latency path: parsed from the prefill (first token) and the decode node (the rest),
rendered exactly as vLLM's OpenAI server renders them (completions and chat).

vLLM keeps, per token, an ordered dict {sampled token: logprob, then the top-n best}: completions show
its first n+1 entries, chat its first n. Token strings are vLLM's `convert_ids_list_to_tokens`
(vllm/tokenizers/detokenizer_utils.py, v0.32): `decode([id])` with the leading spaces of a SentencePiece
piece restored, and a byte-fallback piece ending in U+FFFD re-decoded with the preceding sampled tokens
(vllm/v1/engine/logprobs.py, _verify_tokens). Both are re-stated here because importing them pulls torch
into the router; tests/router/test_agents_logprobs.py compares the results with vLLM's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOKEN_ID_PREFIX = "token_id:"
FLOOR = -9999.0  # vLLM's JSON-safe stand-in for -inf
_MARKER_ATTR = "_tilepd_space_marker"


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id and logprob, and the top (id, logprob) pairs, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def from_node(msg: dict[str, Any]) -> TokenLogprob:
    """A decode-node stream line {"token", "logprob", "top_logprobs": [[id, lp], ...]}."""
    return TokenLogprob(int(msg["token"]), float(msg["logprob"]), tuple((int(t), float(v)) for t, v in msg.get("top_logprobs") or ()))


def from_prefill(choice: dict[str, Any], top_n: int) -> TokenLogprob:
    """The prefill's first token from vLLM's completions logprobs (--return-tokens-as-token-ids keys)."""
    lp = choice["logprobs"]
    token = token_id(lp["tokens"][0])
    entries = [(token_id(k), float(v)) for k, v in (lp["top_logprobs"][0] or {}).items()]
    # the dict is {sampled, top...}: the top n are its n best values (a sampled token outside them sorts last)
    top = sorted(entries, key=lambda e: -e[1])[:top_n]
    return TokenLogprob(token, float(lp["token_logprobs"][0]), tuple(top))


def token_id(text: str) -> int:
    """A vLLM token string under --return-tokens-as-token-ids (`token_id:N`) -> N; ValueError naming the flag."""
    if not text.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"token {text!r} has no '{TOKEN_ID_PREFIX}' prefix: start vLLM with --return-tokens-as-token-ids")
    return int(text[len(TOKEN_ID_PREFIX):])


def space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character of a SentencePiece-style tokenizer (None: decode() keeps spaces)."""
    cached = getattr(tokenizer, _MARKER_ATTR, "unset")
    if cached != "unset":
        return cached
    result = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
        except ValueError:
            pre = {}
        subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        for sub in subs:
            if (sub or {}).get("type") == "Metaspace":
                result = sub.get("replacement", "\u2581")
                break
    setattr(tokenizer, _MARKER_ATTR, result)
    return result


def token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    """vLLM's convert_ids_list_to_tokens."""
    marker = space_marker(tokenizer)
    if marker is None:
        return [tokenizer.decode([t]) or "" for t in ids]
    out = []
    for tid, raw in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        text = tokenizer.decode([tid]) or ""
        n = len(raw) - len(raw.lstrip(marker)) if raw else 0
        missing = n - (len(text) - len(text.lstrip(" ")))
        out.append(" " * missing + text if n and missing > 0 else text)
    return out


def corrected(tokenizer: Any, token_id: int, context: list[int]) -> str:
    """vLLM's LogprobsProcessor._correct_decoded_token: the text a byte-fallback token completes, using the
    preceding sampled tokens (up to 4), or "" while the UTF-8 sequence is still incomplete."""
    for num_ctx in range(1, min(len(context), 4) + 1):
        ctx = context[-num_ctx:]
        full = tokenizer.decode(ctx + [token_id])
        if full.endswith("\ufffd"):
            continue
        clean_end = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if tokenizer.decode([ctx[j]]).endswith("\ufffd"):
                clean_end = j
            else:
                break
        prefix = tokenizer.decode(ctx[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for x, y in zip(prefix, full):
            if x != y:
                break
            common += 1
        return full[common:]
    return ""


class LogprobsRenderer:
    """Renders one request's TokenLogprob records, in order, as vLLM does (n: the top_logprobs / logprobs asked)."""

    def __init__(self, tokenizer: Any, top_n: int) -> None:
        self.tokenizer = tokenizer
        self.top_n = top_n
        self._strings: dict[int, str] = {}
        self._context: list[int] = []  # the sampled tokens so far: vLLM's context for byte-fallback pieces

    def _str(self, tid: int) -> str:
        s = self._strings.get(tid)
        if s is None:
            s = self._strings[tid] = token_strings(self.tokenizer, [tid])[0]
        return s

    def _position(self, rec: TokenLogprob) -> list[tuple[str, int, float]]:
        """vLLM's ordered {sampled, top...} entries of one position as (text, id, logprob); advances the context."""
        d = {rec.token: rec.logprob}
        for tid, v in rec.top:
            d[tid] = v
        out = []
        for tid, v in d.items():
            text = self._str(tid)
            if text.endswith("\ufffd"):
                text = corrected(self.tokenizer, tid, self._context[-4:])
            out.append((text, tid, v))
        self._context.append(rec.token)
        return out

    def completions(self, records: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for rec in records:
            entries = self._position(rec)
            tok = entries[0][0]
            offsets.append(text_offset)
            text_offset += len(tok)
            tokens.append(tok)
            values.append(max(rec.logprob, FLOOR))
            tops.append({t: max(v, FLOOR) for i, (t, _, v) in enumerate(entries) if i <= self.top_n})
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}

    def chat(self, records: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for rec in records:
            entries = self._position(rec)
            tok = entries[0][0]
            top = [{"token": t, "logprob": max(v, FLOOR), "bytes": list(t.encode("utf-8", errors="replace"))}
                   for i, (t, _, v) in enumerate(entries) if i < self.top_n]
            content.append({"token": tok, "logprob": max(rec.logprob, FLOOR), "bytes": list(tok.encode("utf-8", errors="replace")),
                            "top_logprobs": top})
        return {"content": content}
