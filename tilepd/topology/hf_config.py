"""The model's config.json as `validate` sees it: the checkpoint's own file when this machine can read it,
else the bundled figures of the repo id in `model.hf_id`, else nothing (and the rules that need it say so)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tilepd.topology.known_models import known_model
from tilepd.topology.schema import Topology

MAX_CONFIG_BYTES = 4 << 20  # config.json files are a few KB; a bound keeps a wrong path from being read whole


class ConfigFileError(Exception):
    """config.json exists at hf_path but cannot be used (not JSON, not an object, too large)."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}")


@dataclass(frozen=True)
class HfConfig:
    config: dict[str, Any]
    source: str  # the config.json path, or "bundled figures of <hf_id> (<citation>)"
    from_file: bool


def read_config_file(hf_path: str) -> HfConfig | None:
    """`<hf_path>/config.json` when it is readable here; None when it is absent or unreadable (the
    operator's machine need not hold the checkpoint). Raises ConfigFileError when it is there but broken."""
    path = Path(hf_path) / "config.json"
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigFileError(str(path), f"larger than {MAX_CONFIG_BYTES} bytes; not a model's config.json")
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigFileError(str(path), f"not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigFileError(str(path), f"a config.json is a JSON object, this one is {type(cfg).__name__}")
    return HfConfig(cfg, str(path), True)


def model_config(topo: Topology) -> HfConfig | None:
    """The checkpoint's config.json if readable here, else the bundled entry of model.hf_id, else None.
    Raises ConfigFileError for a broken config.json (a finding of rule model-config)."""
    found = read_config_file(topo.model.hf_path)
    if found is not None:
        return found
    if topo.model.hf_id:
        known = known_model(topo.model.hf_id)
        if known is not None:
            return HfConfig(known.config, f"bundled figures of {known.hf_id} ({known.source})", False)
    return None
