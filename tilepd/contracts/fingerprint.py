"""The deployment fingerprint: which checkpoint a service serves, computed the same way on both ends of a handoff.

Prefill and decode drift apart across upgrades (a new checkpoint on one side, same shapes) while every health
check stays green; the cache-layout check of the hello cannot see it. So each side names the checkpoint it serves:

- the converter records the source checkpoint's `CheckpointIdentity` in the weights manifest (`source_identity`),
  and a decode node reports it with its own facts (converter and layout versions, weight dtype);
- the prefill's connector computes the identity from the checkpoint vLLM loaded, with its facts (vLLM version,
  kv-cache dtype, MTP);
- the decode node refuses a hello whose identity differs (`fingerprint_mismatch`), before any byte moves, and the
  connector refuses a claim whose node the router says holds another one (`compare` names both sides' values).

The identity is cheap to compute on a 1 TB checkpoint: every safetensors file's header (names, dtypes, shapes,
offsets) and `SAMPLE_BYTES` of each tensor at its start, middle and end, not all bytes (the manifest's `sources`
keep full sha256s for the converter's skip rule). Two checkpoints of one architecture with other values (another
fine-tune, a merged LoRA, another quantisation) differ in every sampled window of the tensors that changed; a
checkpoint that changes bytes only between the windows of every tensor is not told apart. JSON files (config,
generation config, tokenizer files) are hashed in canonical form, so whitespace and key order do not count.

Stdlib and pydantic only: the vLLM connector, the decode node, the converter, the supervisor on each host and the
doctor compute it. `python -m tilepd.contracts.fingerprint DIR` prints a directory's identity as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

IDENTITY_METHOD = 1  # how CheckpointIdentity is computed; identities of two methods are not compared
SAMPLE_BYTES = 64  # per window; each tensor contributes its first, middle and last window
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "chat_template.jinja", "chat_template.json")
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
SHORT = 12  # hex digits of a fingerprint's id as people read it


class FingerprintError(Exception):
    """A checkpoint whose identity cannot be computed (no config.json, no safetensors, a truncated file)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckpointIdentity(_Frozen):
    """What a checkpoint is, by content: sha256 hex digests of its parts."""

    method: int = IDENTITY_METHOD
    weights: str  # the safetensors files: names, sizes, headers and sampled tensor bytes
    index: str | None = None  # model.safetensors.index.json (canonical), when the checkpoint has one
    config: str  # config.json and generation_config.json (canonical)
    tokenizer: str | None = None  # the tokenizer files present (canonical JSON, raw bytes otherwise)

    @property
    def id(self) -> str:
        """One short id of the whole identity (what `tilepd status` shows)."""
        return _sha(json.dumps(self.model_dump(), sort_keys=True).encode())[:SHORT]

    def parts(self) -> dict[str, str | None]:
        return {"weights": self.weights, "index": self.index, "config": self.config, "tokenizer": self.tokenizer}


Role = Literal["prefill", "decode", "native_decode"]


class Fingerprint(_Frozen):
    """A service's checkpoint identity and the facts of its side (decode: converter_version, layout_version,
    weights_dtype; prefill: vllm_version, kv_cache_dtype, mtp). Only the identity must be equal across a handoff:
    the facts are shown so that a mismatch message says what each side runs."""

    role: Role
    checkpoint: CheckpointIdentity | None  # None: not known (weights converted before fingerprints existed)
    facts: dict[str, str] = {}

    @property
    def id(self) -> str:
        return self.checkpoint.id if self.checkpoint is not None else "unknown"

    def describe(self) -> str:
        """`checkpoint <id> (weights <8>.., config <8>.., tokenizer <8>..; <fact> <value>, ...)` for messages."""
        if self.checkpoint is None:
            head = "checkpoint unknown (no source_identity in its weights manifest)"
        else:
            parts = ", ".join(f"{k} {v[:8]}.." for k, v in self.checkpoint.parts().items() if v)
            head = f"checkpoint {self.id} ({parts})"
        facts = ", ".join(f"{k} {v}" for k, v in sorted(self.facts.items()))
        return head + (f"; {facts}" if facts else "")


def differences(a: CheckpointIdentity | None, b: CheckpointIdentity | None) -> list[str]:
    """The parts in which two identities differ ([] when equal); an unknown side or another method differs whole."""
    if a is None or b is None:
        return ["unknown"]
    if a.method != b.method:
        return [f"method {a.method} vs {b.method}"]
    pa, pb = a.parts(), b.parts()
    return [k for k in pa if pa[k] != pb[k]]


def compare(prefill: Fingerprint | None, node: Fingerprint | None, node_name: str = "") -> str | None:
    """None when the prefill and the decode node serve one checkpoint, or one side reports no fingerprint to compare
    (the vLLM connector always sends one; a tool or test that sends KV by itself, or an in-process node, may not);
    otherwise the mismatch, naming both sides' values and what to do."""
    if node is None or prefill is None:
        return None
    diff = differences(prefill.checkpoint, node.checkpoint)
    if not diff:
        return None
    who = f"decode node {node_name}" if node_name else "the decode node"
    if node.checkpoint is None:
        fix = f"re-convert {who}'s weights (`tilepd up` or `tilepd convert-weights`): its manifest predates fingerprints"
    else:
        fix = (f"convert the prefill's checkpoint for {who} (`tilepd up` converts what model.hf_path holds) or serve "
               "the checkpoint the node was converted from on the prefill")
    return (f"the prefill serves {prefill.describe()}, but {who} holds weights converted from {node.describe()}: "
            f"they differ in {', '.join(diff)}; {fix}")


# -- computing an identity ------------------------------------------------------------------------------------------

def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(path: Path) -> bytes:
    """A JSON file's content with sorted keys and no whitespace (raw bytes for anything else)."""
    raw = path.read_bytes()
    if path.suffix != ".json":
        return raw
    try:
        return json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise FingerprintError(f"{path}: not valid JSON ({exc})") from exc


def _files_digest(root: Path, names: tuple[str, ...]) -> str | None:
    h = hashlib.sha256()
    seen = False
    for name in names:
        p = root / name
        if p.is_file():
            seen = True
            body = _canonical(p)
            h.update(f"{name}\0{len(body)}\0".encode())
            h.update(body)
    return h.hexdigest() if seen else None


def config_digest(model_dir: Path) -> str:
    if not (Path(model_dir) / "config.json").is_file():
        raise FingerprintError(f"{model_dir}: no config.json (not an HF checkpoint directory)")
    digest = _files_digest(Path(model_dir), CONFIG_FILES)
    assert digest is not None
    return digest


def tokenizer_digest(tokenizer_dir: Path) -> str | None:
    return _files_digest(Path(tokenizer_dir), TOKENIZER_FILES)


def index_digest(model_dir: Path) -> str | None:
    return _files_digest(Path(model_dir), (INDEX_FILE,))


def _windows(begin: int, end: int) -> list[tuple[int, int]]:
    n = end - begin
    if n <= 3 * SAMPLE_BYTES:
        return [(begin, n)]
    mid = begin + (n - SAMPLE_BYTES) // 2
    return [(begin, SAMPLE_BYTES), (mid, SAMPLE_BYTES), (end - SAMPLE_BYTES, SAMPLE_BYTES)]


def _file_digest(path: Path) -> str:
    """One safetensors file: its size, its header and each tensor's windows (in header order, by name)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) != 8:
            raise FingerprintError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise FingerprintError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        header = os.pread(fd, n, 8)
        try:
            entries = json.loads(header)
        except ValueError as exc:
            raise FingerprintError(f"{path}: safetensors header is not JSON ({exc})") from exc
        h.update(f"{size}\0".encode())
        h.update(header)
        base = 8 + n
        for name in sorted(k for k in entries if k != "__metadata__"):
            begin, end = entries[name]["data_offsets"]
            for off, length in _windows(base + int(begin), base + int(end)):
                chunk = os.pread(fd, length, off)
                if len(chunk) != length:
                    raise FingerprintError(f"{path}: tensor {name} ends past the file ({size} bytes): truncated?")
                h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def weights_digest(model_dir: Path, threads: int = 8) -> str:
    """The safetensors files of a checkpoint (sampled: module docstring), by file name."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FingerprintError(f"{model_dir}: no *.safetensors files")
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files)))) as pool:
        digests = list(pool.map(_file_digest, files))
    h = hashlib.sha256()
    for path, digest in zip(files, digests):
        h.update(f"{path.name}\0{digest}\0".encode())
    return h.hexdigest()


def checkpoint_identity(model_dir: Path, tokenizer_dir: Path | None = None) -> CheckpointIdentity:
    """The identity of an HF checkpoint directory (tokenizer files read from `tokenizer_dir` when given)."""
    model_dir = Path(model_dir)
    config = config_digest(model_dir)  # first: a directory without config.json is no checkpoint at all
    return CheckpointIdentity(weights=weights_digest(model_dir), index=index_digest(model_dir), config=config,
                              tokenizer=tokenizer_digest(tokenizer_dir or model_dir))


def refreshed_identity(recorded: dict[str, Any] | None, model_dir: Path) -> CheckpointIdentity:
    """A manifest's recorded identity with its cheap parts (config, index, tokenizer) read again: the converter's
    skip rule has just found every safetensors file unchanged, so the weights part stands; none recorded (a manifest
    of an older converter) or another method: computed whole."""
    try:
        old = CheckpointIdentity.model_validate(recorded) if recorded else None
    except ValueError:
        old = None
    if old is None or old.method != IDENTITY_METHOD:
        return checkpoint_identity(model_dir)
    return CheckpointIdentity(weights=old.weights, index=index_digest(model_dir), config=config_digest(model_dir),
                              tokenizer=tokenizer_digest(model_dir))


def main(argv: list[str]) -> int:
    """`python -m tilepd.contracts.fingerprint DIR [TOKENIZER_DIR]`: the identity as one JSON line (doctor, status)."""
    if not 1 <= len(argv) <= 2:
        print("usage: python -m tilepd.contracts.fingerprint MODEL_DIR [TOKENIZER_DIR]", file=sys.stderr)
        return 2
    try:
        ident = checkpoint_identity(Path(argv[0]), Path(argv[1]) if len(argv) > 1 else None)
    except (FingerprintError, OSError) as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps({**ident.model_dump(), "id": ident.id}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
