"""Incremental detokenisation: deltas join to the full decode; no split UTF-8, no lost spaces."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tilepd.router.detok import IncrementalDetokenizer, make_decoder

TEXTS = [
    "héllo wörld 😀 ok, naïve café — 東京 と 大阪",
    " leading spaces  and  doubled  spaces\n\nnew lines\ttabs",
    "🙂🙃🤖 emoji only",
]


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    """A byte-level BPE that knows no emoji or CJK: they decode only from several byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["hello world and some spaces, the quick brown fox"] * 10, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    """SentencePiece-style (Metaspace) tokenizer: a token's leading space is its '▁'."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    alphabet = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>", *alphabet], show_progress=False)
    tok.train_from_iterator(["hello world and some spaces, the quick brown fox"] * 10, trainer=trainer)
    return tok


class _Backend:
    def __init__(self, tok: Tokenizer) -> None:
        self.backend_tokenizer = tok


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(make_decoder(_Backend(tok)), prompt)
    return [detok.add(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_deltas_join_to_full_decode_and_never_split_a_character(byte_bpe: Tokenizer, text: str) -> None:
    ids = byte_bpe.encode(text).ids
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens here
    deltas = _stream(byte_bpe, ids, prompt=byte_bpe.encode("prompt: ").ids)
    assert "".join(deltas) == byte_bpe.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", ["hello world and the fox", "the quick  brown fox 😀 ok"])
def test_metaspace_keeps_leading_spaces_after_the_prompt(metaspace: Tokenizer, text: str) -> None:
    prompt = metaspace.encode("hello").ids
    ids = metaspace.encode(text).ids
    full = metaspace.decode(prompt + ids)
    prompt_text = metaspace.decode(prompt)
    deltas = _stream(metaspace, ids, prompt)
    assert prompt_text + "".join(deltas) == full
    assert "".join(deltas).startswith(" ")  # the space before the first word is not lost
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped(byte_bpe: Tokenizer) -> None:
    eos = byte_bpe.token_to_id("<eos>")
    ids = byte_bpe.encode("hello world").ids + [eos]
    assert "".join(_stream(byte_bpe, ids, [])) == "hello world"


def test_long_stream_matches_full_decode(byte_bpe: Tokenizer) -> None:
    text = " ".join(TEXTS) * 5
    ids = byte_bpe.encode(text).ids
    assert "".join(_stream(byte_bpe, ids, [])) == text


def test_tiny_model_tokenizer_matches_vllm_decode_stream(tmp_path: Path) -> None:
    """The router's deltas equal what vLLM's own fast detokenizer (tokenizers.DecodeStream) emits."""
    from transformers import AutoTokenizer

    from tilepd.dev.tiny_model import _train_tokenizer

    _train_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(" there was a little engine, 😀 ünïcode and Paris.", add_special_tokens=False)
    stream = decoders.DecodeStream(ids=prompt, skip_special_tokens=True)
    vllm_deltas = [stream.step(tok.backend_tokenizer, i) or "" for i in ids]
    detok = IncrementalDetokenizer(make_decoder(tok), prompt)
    ours = [detok.add(i) for i in ids]
    assert "".join(ours) == "".join(vllm_deltas)
