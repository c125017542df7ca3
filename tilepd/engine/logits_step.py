"""A decode step that hands the next position's logits back instead of sampling inside the graph.

Requests that need the logits after the model (logprobs, a grammar's token bitmask) run this step:
on CUDA the model forward is still one captured graph per cache window (the same buckets as
cuda_graph.GraphStep), writing its logits into a static buffer; masking, sampling and logprobs run
after the replay. Plain requests keep the sampling-in-graph step and pay nothing for this one.
"""

from __future__ import annotations

import torch

from tilepd.engine.cuda_graph import GraphStep


class LogitsStep(GraphStep):
    """(io, pos) -> logits [V] of the token at `pos`; io.position is advanced, io.token left for the caller."""

    def __init__(self, model, sampler, io, max_seq_len: int, vocab_size: int, *, capture: bool | None = None) -> None:
        super().__init__(model, sampler, io, max_seq_len, capture=capture)
        self.out = torch.zeros(vocab_size, dtype=torch.float32, device=io.token.device)

    def window(self, needed: int) -> int:
        # uncaptured (CPU) the attention window is the live prefix, exactly as EagerStep runs it
        return super().window(needed) if self.capture else needed

    def _body(self, attn_len: int, use_greedy: bool) -> None:
        io = self.io
        logits, _ = self.model.forward(io.token, io.position, attn_len)
        self.out.copy_(logits[-1])
        io.position.add_(1)

    def logits(self, io, pos: int) -> torch.Tensor:
        super().__call__(io, pos, True)
        return self.out
