"""Read a service config file (tilepd.contracts.service_configs) the same way in every process that starts from one."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

ConfigT = TypeVar("ConfigT", bound=BaseModel)


class ServiceConfigError(Exception):
    """The config file is missing, unreadable or invalid; the message names the file and every bad field."""


def read_service_config(path: Path, model: type[ConfigT]) -> ConfigT:
    """The file at `path` as `model`; a ServiceConfigError (file, field, problem) rather than a traceback."""
    try:
        raw = Path(path).read_text()
    except FileNotFoundError as exc:
        raise ServiceConfigError(f"{path}: config file not found") from exc
    except OSError as exc:
        raise ServiceConfigError(f"{path}: {exc.strerror}") from exc
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors())
        raise ServiceConfigError(f"{path}: invalid {model.__name__}: {problems}") from exc
