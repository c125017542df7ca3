"""tilepd.router: the OpenAI-compatible front door of a tilepd deployment.

Serves /v1/chat/completions and /v1/completions from the low-latency pool (vLLM
prefill + a leased batch=1 decode node) or, for what that pool cannot honour or when
it is busy, from a native vLLM P/D pool. Start it with `python -m tilepd.router
--config FILE` (a `RouterConfig` JSON) or `tilepd router --config FILE`.
"""
