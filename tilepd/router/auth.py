"""Bearer API keys, read from an env var or a file the topology names; compared in constant time."""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tilepd.router.errors import RouterError

log = logging.getLogger("tilepd.router")


class ApiKeyConfigError(Exception):
    """The config names a key source that is missing or empty: refuse to start open by accident."""


@dataclass(frozen=True)
class ApiKeys:
    keys: tuple[bytes, ...]

    @property
    def open(self) -> bool:
        return not self.keys

    @classmethod
    def load(cls, env_var: str | None, key_file: Path | None) -> ApiKeys:
        """Keys are comma/newline separated, in the env var and in the file alike (`old,new` or one per line: both keys
        work, which is how a key is rotated); blank lines and `#` comment lines in the file are ignored."""
        keys: list[str] = []
        if env_var:
            value = os.environ.get(env_var)
            if not value:
                raise ApiKeyConfigError(f"api_key_env names {env_var}, which is not set or empty")
            keys += [k.strip() for k in value.replace("\n", ",").split(",") if k.strip()]
        if key_file:
            try:
                lines = Path(key_file).read_text().splitlines()
            except OSError as exc:
                raise ApiKeyConfigError(f"api_key_file {key_file}: {exc.strerror}") from exc
            found = [k.strip() for ln in lines if not ln.strip().startswith("#") for k in ln.split(",") if k.strip()]
            if not found:
                raise ApiKeyConfigError(f"api_key_file {key_file} holds no key")
            keys += found
        return cls(tuple(k.encode() for k in keys))

    def check(self, authorization: str | None) -> None:
        """Raise 401 unless the header carries one of the keys."""
        if self.open:
            return
        presented = b""
        if authorization and authorization[:7].lower() == "bearer ":
            presented = authorization[7:].strip().encode()
        ok = False
        for key in self.keys:  # compare with every key: the time does not say which one matched
            ok |= hmac.compare_digest(presented, key)
        if not ok:
            raise RouterError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key",
                              headers={"www-authenticate": "Bearer"})
