"""The divergence watch's choices on the request path (tilepd/router/divergence_watch.py): which finished requests it
can judge, how the sampling rate and the client's ask decide, and that a full queue drops rather than waits. The
checks themselves run against a real prefill in tests/router/test_fingerprint_divergence.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tilepd.contracts.service_configs import DivergenceWatchConfig
from tilepd.router.divergence_watch import DivergenceWatch, asked_to_verify, eligible, probe_prompt


def _run(rid: str = "r1", *, temperature: float = 0.0, top_k: int = 0, structured: object = None, failovers: int = 0,
         tokens: int = 8, prompt: int = 12) -> SimpleNamespace:
    plan = SimpleNamespace(temperature=temperature, top_k=top_k, structured=structured, prompt_ids=list(range(prompt)))
    return SimpleNamespace(plan=plan, failovers=failovers, tokens=list(range(tokens)), request_id=rid,
                           lease=SimpleNamespace(node=SimpleNamespace(name="d0")))


def _watch(draws: list[float], **cfg: object) -> DivergenceWatch:
    state = SimpleNamespace(pool=SimpleNamespace(nodes=[SimpleNamespace(name="d0")]))
    it = iter(draws)
    return DivergenceWatch(state, DivergenceWatchConfig(**cfg), draw=lambda: next(it))  # type: ignore[arg-type]


def test_only_greedy_single_node_requests_with_a_node_token_are_judged() -> None:
    assert eligible(_run()) is None
    assert eligible(_run(temperature=0.7, top_k=1)) is None  # top_k 1 is greedy too
    assert "sampled" in (eligible(_run(temperature=0.7)) or "")
    assert "structured-output" in (eligible(_run(structured=object())) or "")
    assert "more than one node" in (eligible(_run(failovers=1)) or "")
    assert "no token from the node" in (eligible(_run(tokens=1)) or "")


def test_the_rate_samples_the_ask_always_checks_and_a_full_queue_drops() -> None:
    async def go() -> None:
        w = _watch([0.5, 0.001, 0.002, 0.003, 0.004], sample_rate=0.01, queue_size=2, max_checked_tokens=4)
        w.offer(_run("not-drawn"), False)  # 0.5 >= 0.01
        w.offer(_run("drawn"), False)  # 0.001
        w.offer(_run("asked"), True)  # no draw needed
        w.offer(_run("dropped"), False)  # drawn (0.002), but the queue holds 2
        assert [w.queue.get_nowait().request_id for _ in range(w.queue.qsize())] == ["drawn", "asked"]
        assert w.dropped == 1
        w.offer(_run("long", prompt=5000), False)  # drawn, longer than max_context_tokens: not queued, nothing said
        w.offer(_run("sampled", temperature=1.0), True)  # asked but not judgeable: its verdict says why
        assert w.queue.empty() and w.recent[-1]["request_id"] == "sampled"
        assert "not checked: sampled" in w.recent[-1]["verdict"]["summary"]
        off = _watch([], enabled=False)
        off.offer(_run(), True)
        assert off.queue.empty()

    asyncio.run(go())


def test_a_sample_keeps_the_prompt_and_at_most_max_checked_tokens() -> None:
    async def go() -> None:
        w = _watch([0.0], sample_rate=0.5, max_checked_tokens=4)
        w.offer(_run(tokens=10), False)
        s = w.queue.get_nowait()
        assert (s.node, s.prompt, s.tokens, s.source) == ("d0", list(range(12)), [0, 1, 2, 3], "request")

    asyncio.run(go())


def test_probe_prompts_are_fixed_per_seed_and_in_the_vocabulary() -> None:
    assert probe_prompt(3, 500) == probe_prompt(3, 500) != probe_prompt(4, 500)
    assert all(100 <= t < 500 for t in probe_prompt(3, 500)) and len(probe_prompt(3, 500)) == 16
    assert asked_to_verify({"x-tilepd-verify": "1"}) and asked_to_verify({"x-tilepd-verify": "true"})
    assert not asked_to_verify({}) and not asked_to_verify({"x-tilepd-verify": "0"})
