"""Grammar-constrained decoding in the engine (xgrammar, as vLLM compiles it): every token obeys the
bitmask, the output parses and validates against the schema, malformed constraints name the field."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from tilepd.engine import SamplingParams, load_engine
from tilepd.engine.grammar import Constraint, GrammarCompiler, GrammarError

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    return load_engine(tiny_llama, device="cpu", max_seq_len=256, dtype="float32")


@pytest.fixture(scope="module")
def compiler(tiny_llama: Path, engine) -> GrammarCompiler:
    return GrammarCompiler.from_pretrained(tiny_llama, engine.config.vocab_size)


def _constrained(engine, compiler, ref, constraint: Constraint, max_tokens: int = 96, **kw) -> list[int]:
    """The first token as the prefill would sample it (HF's last prompt logits under the mask), then the engine."""
    eos = set(engine.config.eos_token_ids)
    state = compiler.matcher(compiler.compile(constraint), eos)
    logits = ref.logits[0].float().clone()
    state.mask(logits)
    first = int(torch.argmax(logits))
    assert state.accept(first)
    engine.inject(ref.state)
    res = engine.decode(first, max_tokens, SamplingParams(**kw), lambda t: None, None, grammar=state)
    assert res.finish_reason == "stop", res
    return [first, *res.tokens]


def test_json_schema_output_validates(engine, compiler, llama_ref, tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for kw in ({}, {"temperature": 1.0, "seed": 3}):
        ids = _constrained(engine, compiler, llama_ref, Constraint("json_schema", json.dumps(SCHEMA)), **kw)
        assert ids[-1] in engine.config.eos_token_ids
        jsonschema.validate(json.loads(tok.decode(ids[:-1])), SCHEMA)


def test_regex_output_matches(engine, compiler, llama_ref, tiny_llama: Path) -> None:
    import re

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = _constrained(engine, compiler, llama_ref, Constraint("regex", r"(yes|no) [0-9]{2}"))
    assert re.fullmatch(r"(yes|no) [0-9]{2}", tok.decode(ids[:-1]))


def test_malformed_constraints_name_the_field(compiler) -> None:
    with pytest.raises(GrammarError, match="structured_output.spec") as exc:
        compiler.compile(Constraint("json_schema", "{not json"))
    assert exc.value.field == "structured_output.spec"
    with pytest.raises(GrammarError, match="response_format.json_schema.spec"):
        compiler.compile(Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}})),
                         "response_format.json_schema")
    with pytest.raises(GrammarError, match="structured_output.type"):
        compiler.compile(Constraint("choice", "[]"))


def test_choice_compiles_as_the_grammar_vllm_builds(engine, compiler, llama_ref, tiny_llama: Path) -> None:
    """The router sends structured_outputs.choice to the node as vLLM's choice_as_grammar EBNF (kind "grammar"),
    which is what vLLM's xgrammar backend compiles for a choice: the output is one of the choices."""
    from tilepd.router.structured import choice_as_grammar

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    choices = ["red", "green", 'dark "blue"']
    ids = _constrained(engine, compiler, llama_ref, Constraint("grammar", choice_as_grammar(choices)))
    assert tok.decode(ids[:-1]) in choices


def test_the_compile_cache_is_bounded_by_bytes(tiny_llama: Path, engine) -> None:
    """Distinct schemas (what a client controls) past the bound evict the least recently used: the cache stays under it.
    Unbounded (the old default), the same loop leaves all of them compiled."""
    def fill(c: GrammarCompiler) -> int:
        for i in range(40):
            schema = {"type": "object", "properties": {f"k{i}_{j}": {"type": "integer"} for j in range(8)}, "required": [f"k{i}_0"]}
            c.compile(Constraint("json_schema", json.dumps(schema)))
        return c.cache_bytes

    unbounded = fill(GrammarCompiler.from_pretrained(tiny_llama, engine.config.vocab_size, cache_limit_bytes=-1))
    limit = unbounded // 4
    bounded = GrammarCompiler.from_pretrained(tiny_llama, engine.config.vocab_size, cache_limit_bytes=limit)
    assert 0 < fill(bounded) <= limit < unbounded, (bounded.cache_bytes, limit, unbounded)
