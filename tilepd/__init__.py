"""tilepd: one topology file to a running disaggregated vLLM + batch=1 decode deployment."""

__version__ = "0.3.0"
