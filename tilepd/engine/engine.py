"""The batch-1 decode engine behind the decode server (INTERFACES §1).

One request at a time: `inject` copies the received prefix into the static cache, `decode` feeds the
first token at position seq_len and streams generated tokens until EOS / a stop id / max_tokens / the
end of the cache / cancel (checked before every step). Each step is `model.forward` on one token plus
the on-device sampler; on CUDA the step is a captured graph (cuda_graph.py) and only the token id is
read back. DeepSeek-V3 checkpoints with an MTP layer decode greedily through mtp.py (the verify +
draft step, also one captured graph per window on CUDA).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tilepd.engine.logprobs import TOP_LOGPROBS_MAX, TokenLogprobs, token_logprobs
from tilepd.engine.sampling import SamplerState, greedy
from tilepd.model_format.model_spec import ModelSpec
from tilepd.engine.types import DecodeResult, FinishReason, InProcessEngine, KVState, SamplingParams

CAPABILITIES: dict[str, Any] = {
    "temperature": True, "top_p": True, "top_k": True, "seed": True, "stop_token_ids": True, "ignore_eos": True,
    "max_tokens": True, "logprobs": True, "top_logprobs": True, "top_logprobs_max": TOP_LOGPROBS_MAX,
    "structured_output": ["json_schema", "json_object", "regex", "grammar", "structural_tag"],  # tilepd.engine.grammar.KINDS
    "n": False, "presence_penalty": False, "frequency_penalty": False,
    "repetition_penalty": False, "min_p": False, "min_tokens": False, "logit_bias": False, "stop": False,
}


@dataclass
class StepIO:
    """Static device buffers of one decode step: the input token and its position (both [1] long)."""

    token: torch.Tensor
    position: torch.Tensor


class EagerStep:
    """One decode step without graphs (CPU, or CUDA fallback). The attention window is the live prefix."""

    def __init__(self, model, sampler: SamplerState) -> None:
        self.model = model
        self.sampler = sampler
        self.logits_log: list[torch.Tensor] | None = None  # tests: per-step logits

    def __call__(self, io: StepIO, pos: int, use_greedy: bool) -> torch.Tensor:
        logits, _ = self.model.forward(io.token, io.position, pos + 1)
        if self.logits_log is not None:
            self.logits_log.append(logits[-1].detach().clone())
        nxt = greedy(logits) if use_greedy else self.sampler(logits[-1])
        io.token.copy_(nxt.view(1))
        io.position.add_(1)
        return io.token


class Engine(InProcessEngine):
    """Batch-1 decoder over a static cache sized for max_seq_len tokens."""

    def __init__(self, model, spec: ModelSpec, device: torch.device, max_seq_len: int, *, use_cuda_graph: bool | None = None,
                 num_speculative_tokens: int = 0) -> None:
        self.model = model
        self.config = spec
        self.device = device
        self.max_seq_len = max_seq_len
        self.seq_len = 0
        self.sampler = SamplerState(spec.vocab_size, device)
        self.io = StepIO(torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device))
        self.eager_step = EagerStep(model, self.sampler)
        self.graph_step = None
        self._logits_step = None  # built on the first request that needs the logits (logprobs, grammar)
        if use_cuda_graph is None:
            use_cuda_graph = device.type == "cuda"
        if use_cuda_graph:  # on CPU: the graph's static-shape body, run eagerly (tests)
            from tilepd.engine.cuda_graph import GraphStep

            self.graph_step = GraphStep(model, self.sampler, self.io, max_seq_len)
        self.num_speculative_tokens = num_speculative_tokens if getattr(model, "has_mtp", False) else 0
        self.last_mtp_stats: dict[str, float] = {}
        self._mtp_step = None  # mtp.MtpStep, built on the first speculative request
        self.speed_path = "graph" if self.graph_step is not None and device.type == "cuda" else "eager"

    @property
    def capabilities(self) -> dict[str, Any]:
        return {**CAPABILITIES, "speculative_mtp": self.num_speculative_tokens > 0}

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.model.caches[0].dtype

    @torch.no_grad()
    def warmup(self, max_windows: int | None = None) -> int:
        """Capture the greedy decode graphs (and the MTP step's) ahead of the first request (CUDA); returns how many exist."""
        if self.graph_step is None:
            return 0
        n = self.graph_step.warmup(True, max_windows)
        if self.num_speculative_tokens > 0:
            from tilepd.engine.mtp import mtp_step

            n += mtp_step(self).warmup(max_windows)
        return n

    def reset(self) -> None:
        """Forget the current request (the cache is overwritten by the next inject; no clearing needed)."""
        self.seq_len = 0

    @torch.no_grad()
    def inject(self, state: KVState) -> None:
        """Copy a prefix in the engine layout into positions [0, state.seq_len) of every layer's cache.

        deepseek_v3 with MTP: a state may carry num_layers + num_mtp_layers tensors (a prefill that ran
        the draft layer); then the MTP layer sees the whole prefix, else only what it decoded itself.
        DSA models also need `state.indexer` (one entry per entry of `layers`; None for a layer without an
        indexer): a sparse model is never decoded densely for want of its indexer keys."""
        caches = list(self.model.caches)
        mtp_caches = list(getattr(self.model, "mtp_caches", []))
        with_mtp = bool(mtp_caches) and len(state.layers) == len(caches) + len(mtp_caches)
        if with_mtp:
            caches += mtp_caches
        if len(state.layers) != len(caches):
            extra = f" (or {len(caches) + len(mtp_caches)} with the MTP layers)" if mtp_caches else ""
            raise ValueError(f"KVState has {len(state.layers)} layers, the model has {len(caches)}{extra}")
        if not 0 < state.seq_len < self.max_seq_len:
            raise ValueError(f"KVState seq_len {state.seq_len} must be in [1, max_seq_len={self.max_seq_len})")
        want = tuple(caches[0].shape[1:])
        for i, src in enumerate(state.layers):
            if tuple(src.shape) != (state.seq_len, *want):
                raise ValueError(f"KVState layer {i}: shape {list(src.shape)}, expected {[state.seq_len, *want]}")
        index_pairs = self._check_indexer(state, len(caches))
        for src, dst in zip(state.layers, caches):
            dst[: state.seq_len].copy_(src, non_blocking=True)
        for src, dst in index_pairs:
            dst[: state.seq_len].copy_(src, non_blocking=True)
        if hasattr(self.model, "mtp_start"):
            self.model.mtp_start.fill_(0 if with_mtp else state.seq_len)
        self.seq_len = state.seq_len

    def _check_indexer(self, state: KVState, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, destination) pairs of the DSA indexer keys, after checking them all (nothing is copied
        before every tensor is known to fit)."""
        index_list = getattr(self.model, "index_cache_list", None)
        dsa = bool(getattr(self.config, "is_dsa", False))
        if not dsa:
            if state.indexer is not None:
                raise ValueError(f"KVState carries indexer keys but {self.config.model_type} has no sparse-attention indexer")
            return []
        if state.indexer is None:
            raise ValueError(f"{self.config.model_type} uses sparse attention (DSA): KVState.indexer (the lightning indexer's keys "
                             "of every indexed layer) is required; refusing to decode without it (dense attention is a different model)")
        dsts = index_list()[:n]
        if len(state.indexer) != n:
            raise ValueError(f"KVState.indexer has {len(state.indexer)} entries, KVState.layers {n}: one per layer (None for shared layers)")
        pairs = []
        for i, (src, dst) in enumerate(zip(state.indexer, dsts)):
            if dst is None:
                if src is not None:
                    raise ValueError(f"KVState.indexer[{i}]: layer {i} has no indexer of its own (a 'shared' layer); expected None")
                continue
            if src is None:
                raise ValueError(f"KVState.indexer[{i}] is None but layer {i} runs the indexer: its keys are required")
            if tuple(src.shape) != (state.seq_len, dst.shape[1]):
                raise ValueError(f"KVState.indexer[{i}]: shape {list(src.shape)}, expected {[state.seq_len, dst.shape[1]]}")
            pairs.append((src, dst))
        return pairs

    @torch.no_grad()
    def decode(self, first_token: int, max_tokens: int, sampling: SamplingParams, on_token: Callable[[int], None],
               cancel: threading.Event | None = None, *, logprobs: int | None = None,
               on_logprobs: Callable[[TokenLogprobs], None] | None = None, grammar: Any = None) -> DecodeResult:
        """Generate up to max_tokens tokens after first_token (fed at position seq_len).

        logprobs=n (0..20): each token's logprob and its top n, handed to on_logprobs before on_token.
        grammar: a grammar.GrammarState already advanced by first_token; every token obeys it (the bitmask
        is applied to the logits before sampling and logprobs, as vLLM does), and its end is a stop."""
        if self.seq_len == 0:
            raise RuntimeError("decode() before inject(): no prefix in the cache")
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.config.eos_token_ids))
        use_greedy = sampling.greedy
        if logprobs is not None:
            if not 0 <= logprobs <= TOP_LOGPROBS_MAX:
                raise ValueError(f"logprobs must be in [0, {TOP_LOGPROBS_MAX}], got {logprobs}")
        if logprobs is not None or grammar is not None:
            return self._decode_with_logits(first_token, max_tokens, sampling, stops, on_token, cancel, logprobs, on_logprobs, grammar)
        if use_greedy and self.num_speculative_tokens > 0:
            from tilepd.engine.mtp import mtp_decode

            return mtp_decode(self, first_token, max_tokens, stops, on_token, cancel)
        if not use_greedy:
            self.sampler.configure(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        step = self.graph_step or self.eager_step

        def produce(pos: int) -> int:
            if not use_greedy:
                self.sampler.draw_noise()
            return int(step(self.io, pos, use_greedy).item())

        return self._loop(first_token, max_tokens, stops, cancel, produce, on_token)

    def _loop(self, first_token: int, max_tokens: int, stops: set[int], cancel: threading.Event | None,
              produce: Callable[[int], int | None], on_token: Callable[[int], None]) -> DecodeResult:
        """The decode loop both paths share: `produce(pos)` runs one step and returns the token (None: a stop
        without a token, e.g. a finished grammar); cancel, cache end, stop tokens and timings are handled here."""
        self.io.token.fill_(int(first_token))
        self.io.position.fill_(self.seq_len)
        tokens: list[int] = []
        reason: FinishReason = "length"
        t0 = time.perf_counter()
        t_first = 0.0
        pos = self.seq_len
        while len(tokens) < max_tokens:
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            if pos >= self.max_seq_len:
                break
            tok = produce(pos)
            if tok is None:
                reason = "stop"
                break
            if not tokens:
                t_first = time.perf_counter() - t0
            pos += 1
            tokens.append(tok)
            on_token(tok)
            if tok in stops:
                reason = "stop"
                break
        elapsed = time.perf_counter() - t0
        self.seq_len = pos
        n = len(tokens)
        timings = {"decode_ms": elapsed * 1e3, "first_step_ms": t_first * 1e3,
                   "ms_per_token": (elapsed / n * 1e3) if n else 0.0, "tokens": float(n)}
        return DecodeResult(tokens, reason, timings)


    def logits_step(self):
        """The step that returns logits (LogitsStep), captured like the plain step on CUDA."""
        if self._logits_step is None:
            from tilepd.engine.logits_step import LogitsStep

            self._logits_step = LogitsStep(self.model, self.sampler, self.io, self.max_seq_len, self.config.vocab_size,
                                           capture=self.graph_step is not None and self.graph_step.capture)
        return self._logits_step

    def _decode_with_logits(self, first_token: int, max_tokens: int, sampling: SamplingParams, stops: set[int],
                            on_token: Callable[[int], None], cancel: threading.Event | None, logprobs: int | None,
                            on_logprobs: Callable[[TokenLogprobs], None] | None, grammar: Any = None) -> DecodeResult:
        """The decode loop when the logits are needed after the model: no speculation (greedy output is the same)."""
        use_greedy = sampling.greedy
        if not use_greedy:
            self.sampler.configure(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        step = self.logits_step()

        def produce(pos: int) -> int | None:
            if grammar is not None and grammar.terminated:  # its stop token was accepted (ignore_eos kept the loop going)
                return None
            logits = step.logits(self.io, pos)
            if grammar is not None:
                grammar.mask(logits)
            if use_greedy:
                nxt = greedy(logits)
            else:
                self.sampler.draw_noise()
                nxt = self.sampler(logits)
            self.io.token.copy_(nxt.view(1))
            tok = int(nxt.item())
            if grammar is not None and not grammar.accept(tok):
                raise RuntimeError(f"token {tok} sampled under the grammar's bitmask was rejected by its matcher")
            if logprobs is not None and on_logprobs is not None:
                on_logprobs(token_logprobs(logits, tok, logprobs))
            return tok

        return self._loop(first_token, max_tokens, stops, cancel, produce, on_token)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def build_model(spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int, device: torch.device, cache_dtype: torch.dtype):
    if spec.family == "llama":
        from tilepd.engine.llama import LlamaModel

        return LlamaModel(spec, weights, max_seq_len, device, cache_dtype)
    if spec.family == "deepseek_v3":
        from tilepd.engine.deepseek_v3 import DeepseekV3Model

        return DeepseekV3Model(spec, weights, max_seq_len, device, cache_dtype)
    raise ValueError(f"no engine for family {spec.family!r}")


def load_engine(weights_dir, device: str = "cpu", max_seq_len: int = 4096, dtype: str | None = None, *,
                use_cuda_graph: bool | None = None, num_speculative_tokens: int | None = None, cpu_threads: int = 1,
                speed_path: bool = True) -> Engine:
    """Load converted weights (or an HF checkpoint, converted in memory) and allocate the static cache.

    dtype: compute and cache dtype (default bfloat16 on CUDA, float32 on CPU). num_speculative_tokens:
    MTP drafts per step for deepseek_v3 checkpoints with an MTP layer (default 1 when present; 0 disables).
    cpu_threads: on CPU, torch's intra-op threads for this process (the CPU path serves tiny test/demo
    models, whose batch-1 GEMVs only lose from threads, badly so on shared cores); 0 leaves torch's setting.
    speed_path: on CUDA with graphs, compiled.accelerate (Triton split-KV attention + torch.compile'd
    layers, each undone by itself if it fails at the first capture); engine.speed_path names what is on.
    """
    from tilepd.engine.weights_loader import load_weights

    dev = torch.device(device)
    if dev.type == "cpu" and cpu_threads > 0:
        torch.set_num_threads(cpu_threads)
    name = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} not supported (choose from {', '.join(sorted(_DTYPES))})")
    torch_dtype = _DTYPES[name]
    spec, weights = load_weights(weights_dir, dev, torch_dtype)
    spec = spec.with_cache_dtype(str(torch_dtype).removeprefix("torch."))
    model = build_model(spec, weights, max_seq_len, dev, torch_dtype)
    if num_speculative_tokens is None:
        num_speculative_tokens = 1 if getattr(model, "has_mtp", False) else 0
    engine = engine_for(model, spec, dev, max_seq_len, use_cuda_graph=use_cuda_graph,
                        num_speculative_tokens=num_speculative_tokens, speed_path=speed_path)
    from tilepd.engine.memory import log_memory

    engine.memory = log_memory(weights, dev)  # GPU memory at start (weights by format, allocator, free/total)
    return engine


def engine_for(model, spec, device: torch.device, max_seq_len: int, *, use_cuda_graph: bool | None,
               num_speculative_tokens: int, speed_path: bool = True) -> Engine:
    """An Engine over a built model (one rank's or the whole). On CUDA with graphs and speed_path, the model
    first takes compiled.accelerate, whose undo steps the graph step tries one at a time if capture fails."""
    path = None
    if speed_path and device.type == "cuda" and use_cuda_graph is not False:
        from tilepd.engine.compiled import accelerate

        path = accelerate(model)
    engine = Engine(model, spec, device, max_seq_len, use_cuda_graph=use_cuda_graph, num_speculative_tokens=num_speculative_tokens)
    if path is not None and engine.graph_step is not None:
        engine.graph_step.fallbacks = list(path.fallbacks)
        engine.speed_path = path.name
    return engine
