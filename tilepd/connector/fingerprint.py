"""The prefill's deployment fingerprint (tilepd.contracts.fingerprint), from the checkpoint vLLM loaded.

vLLM names its model as `--model` gave it: a directory (what tilepd deployments render: model.hf_path) or a hub id
already in the local cache; the tokenizer may come from `--tokenizer`. The facts beside the identity are the ones
a mismatch message needs: the vLLM release, the kv-cache dtype and the speculative (MTP) config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tilepd.connector import vllm_version
from tilepd.contracts.fingerprint import Fingerprint, FingerprintError, checkpoint_identity


def _local_dir(name: str, revision: str | None) -> Path:
    """A model or tokenizer name as a directory: itself, or its snapshot in the local hub cache (nothing is fetched)."""
    path = Path(name)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - not a directory and not in the cache: say which
        raise FingerprintError(f"{name!r} is no directory and not in the local Hugging Face cache ({type(exc).__name__}: {exc})") from exc


def mtp_fact(speculative_config: Any) -> str:
    """`off`, or the speculative method and its draft count (`mtp x1`)."""
    if speculative_config is None:
        return "off"
    method = getattr(speculative_config, "method", None) or "speculative"
    return f"{method} x{getattr(speculative_config, 'num_speculative_tokens', '?')}"


def prefill_fingerprint(vllm_config: Any) -> Fingerprint:
    """What this prefill serves; FingerprintError names what could not be read."""
    mc = vllm_config.model_config
    revision = getattr(mc, "revision", None)
    model_dir = _local_dir(str(mc.model), revision)
    tok = getattr(mc, "tokenizer", None)
    tokenizer_dir = _local_dir(str(tok), getattr(mc, "tokenizer_revision", None)) if tok and str(tok) != str(mc.model) else model_dir
    found = vllm_version.loaded()
    facts = {
        "vllm_version": found[1] if found else "unknown",
        "kv_cache_dtype": str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")),
        "mtp": mtp_fact(getattr(vllm_config, "speculative_config", None)),
    }
    return Fingerprint(role="prefill", checkpoint=checkpoint_identity(model_dir, tokenizer_dir), facts=facts)
