"""Incremental detokenisation: deltas join to the full decode; no split UTF-8, no lost spaces."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tilepd.router.detok import IncrementalDetokenizer, StreamDetokenizer, make_decoder, make_detokenizer

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


@pytest.fixture(params=["offset", "decode_stream"])
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int], impl: str = "offset") -> list[str]:
    if impl == "offset":
        detok: IncrementalDetokenizer | StreamDetokenizer = IncrementalDetokenizer(make_decoder(_Backend(tok)), prompt)
    else:
        detok = StreamDetokenizer(tok, prompt, skip_special_tokens=True)
    return [detok.add(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_deltas_join_to_full_decode_and_never_split_a_character(byte_bpe: Tokenizer, text: str, impl: str) -> None:
    ids = byte_bpe.encode(text).ids
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens here
    deltas = _stream(byte_bpe, ids, prompt=byte_bpe.encode("prompt: ").ids, impl=impl)
    assert "".join(deltas) == byte_bpe.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", ["hello world and the fox", "the quick  brown fox 😀 ok"])
def test_metaspace_keeps_leading_spaces_after_the_prompt(metaspace: Tokenizer, text: str, impl: str) -> None:
    prompt = metaspace.encode("hello").ids
    ids = metaspace.encode(text).ids
    full = metaspace.decode(prompt + ids)
    prompt_text = metaspace.decode(prompt)
    deltas = _stream(metaspace, ids, prompt, impl)
    assert prompt_text + "".join(deltas) == full
    assert "".join(deltas).startswith(" ")  # the space before the first word is not lost
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped(byte_bpe: Tokenizer, impl: str) -> None:
    eos = byte_bpe.token_to_id("<eos>")
    ids = byte_bpe.encode("hello world").ids + [eos]
    assert "".join(_stream(byte_bpe, ids, [], impl)) == "hello world"


def test_long_stream_matches_full_decode(byte_bpe: Tokenizer, impl: str) -> None:
    text = " ".join(TEXTS) * 5
    ids = byte_bpe.encode(text).ids
    assert "".join(_stream(byte_bpe, ids, [], impl)) == text


def test_router_detokenizer_equals_vllm_on_random_tokens(tmp_path: Path) -> None:
    """Random tiny models emit invalid UTF-8; the router's deltas still equal vLLM's fast detokenizer
    (tokenizers.DecodeStream primed with the prompt), token by token."""
    import random

    from transformers import AutoTokenizer

    from tilepd.dev.tiny_model import _train_tokenizer

    _train_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    for seed in range(50):
        rng = random.Random(seed)
        prompt = [rng.randrange(5, 500) for _ in range(6)]
        ids = [rng.randrange(2, 500) for _ in range(30)]
        stream = decoders.DecodeStream(ids=prompt, skip_special_tokens=True)
        vllm_deltas = [stream.step(tok.backend_tokenizer, i) or "" for i in ids]
        detok = make_detokenizer(tok, prompt)
        assert [detok.add(i) for i in ids] == vllm_deltas, f"seed {seed}"
