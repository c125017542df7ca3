"""Incremental detokenisation: token ids in, text deltas out, without split UTF-8 or lost spaces.

Decoding one token at a time is wrong for byte-level BPE (a multi-byte character can
span tokens) and for SentencePiece (a token's leading space depends on its neighbours).
The offset method decodes a small window of recent tokens twice, with and without the
new ones, and emits only the difference once it no longer ends in a replacement
character. The window is primed with the prompt's last tokens, as vLLM does, so the
first generated token gets the same spacing as in vLLM's own output.

For fast (Rust) tokenizers the router uses `tokenizers.decoders.DecodeStream`, primed
with the prompt, exactly as vLLM's own detokenizer does: the two then agree byte for byte
even on invalid UTF-8 (random tiny models produce it), where the offset method and
DecodeStream differ in when a replacement character is emitted. The offset method
serves every other tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# enough context for every tokenizer we know; bigger costs more per token
PRIME_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


def make_decoder(tokenizer: object, skip_special_tokens: bool = True) -> Callable[[Sequence[int]], str]:
    """A fast `ids -> str` for the tokenizer: the Rust backend when there is one.

    The backend decode skips transformers' `clean_up_tokenization_spaces`, as vLLM's
    own fast detokenizer does, so texts match vLLM's.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)  # type: ignore[attr-defined]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation is the full decode."""

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-PRIME_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = decode(self._ids) if self._ids else ""

    def add(self, token_id: int) -> str:
        """Feed one token; return the new text it completes (possibly empty)."""
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset :]
        text = self._decode(window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            # an incomplete character (or nothing visible yet): wait for more tokens
            return ""
        delta = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset :])
        if len(self._ids) > 4 * PRIME_TOKENS:  # keep the list short: only the window matters
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return delta


class StreamDetokenizer:
    """vLLM's fast path: the tokenizer library's own incremental decoder, primed with the prompt."""

    def __init__(self, backend: object, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception as exc:  # tokenizers raises this on non-monotonic invalid UTF-8; vLLM restarts the stream
            if not str(exc).startswith("Invalid prefix encountered"):
                raise
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._backend, token_id) or ""


def make_detokenizer(tokenizer: object, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer | StreamDetokenizer:
    """The detokenizer vLLM would use for this tokenizer: DecodeStream when it can, else the offset method."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            return StreamDetokenizer(backend, prompt_ids, skip_special_tokens)
        except (ImportError, TypeError):  # tokenizers too old for a primed DecodeStream
            pass
    return IncrementalDetokenizer(make_decoder(tokenizer, skip_special_tokens), prompt_ids)
