"""A service's deployment fingerprint as its own host computes it from the service's spec (`tilepd status --wide`).

The decode node's is the source identity its weights manifest recorded (its live `/status` says the same once it
runs); a vLLM instance's (prefill, native decode) is the identity of the checkpoint its argv names (`--model`,
`--tokenizer`), with its vLLM release, `--kv-cache-dtype` and `--speculative-config`: what its connector computes at
startup (tilepd.connector.fingerprint). Torch-free: the supervisor runs it on every host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tilepd.contracts.fingerprint import Fingerprint, FingerprintError, checkpoint_identity

VLLM_ROLES = ("prefill", "native_decode")


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in an argv (the last one wins, as argparse reads it)."""
    found = None
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith(name + "="):
            found = word.split("=", 1)[1]
    return found


def _mtp(raw: str | None) -> str:
    if not raw:
        return "off"
    try:
        cfg = json.loads(raw)
    except ValueError:
        return raw
    return f"{cfg.get('method') or 'speculative'} x{cfg.get('num_speculative_tokens', '?')}" if isinstance(cfg, dict) else raw


def vllm_fingerprint(role: str, argv: list[str], vllm_version: str | None) -> Fingerprint:
    model = _flag(argv, "--model")
    if model is None:
        raise FingerprintError("its argv names no --model")
    tokenizer = _flag(argv, "--tokenizer")
    facts = {"vllm_version": vllm_version or "unknown", "kv_cache_dtype": _flag(argv, "--kv-cache-dtype") or "auto",
             "mtp": _mtp(_flag(argv, "--speculative-config"))}
    return Fingerprint(role=role, checkpoint=checkpoint_identity(Path(model), Path(tokenizer) if tokenizer else None),  # type: ignore[arg-type]
                       facts=facts)


def decode_fingerprint(argv: list[str]) -> Fingerprint:
    from tilepd.weights.manifest import node_fingerprint

    config = _flag(argv, "--config")
    if config is None:
        raise FingerprintError("its argv names no --config")
    cfg = json.loads(Path(config).read_text())
    return node_fingerprint(Path(cfg["weights_dir"]), str(cfg.get("kv_cache_dtype") or ""))


def summary(fp: Fingerprint) -> dict[str, Any]:
    """What status shows of a fingerprint: its id, the checkpoint's parts, the side's facts."""
    return {"id": fp.id, **({"checkpoint": fp.checkpoint.parts()} if fp.checkpoint is not None else {}), "facts": dict(fp.facts)}


def service_fingerprint(role: str, argv: list[str], vllm_version: str | None = None) -> dict[str, Any] | None:
    """The summary of a prefill, native decode or decode node's fingerprint, {"error": ...} when it cannot be read,
    None for a role without one (the router)."""
    try:
        if role in VLLM_ROLES:
            return summary(vllm_fingerprint(role, argv, vllm_version))
        if role == "decode":
            return summary(decode_fingerprint(argv))
    except (FingerprintError, OSError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return None
