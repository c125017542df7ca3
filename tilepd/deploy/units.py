"""systemd-mode text: ExecStart quoting and EnvironmentFile lines for one service.

argv words can hold JSON (vLLM's --kv-transfer-config), spaces, `%` and `$`, which
systemd would otherwise split, expand as specifiers or as variables. Quoting is done
here, on the controller, so the unit template stays a plain fill-in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def quote_exec_word(word: str) -> str:
    """One argv word for ExecStart=: `%` -> `%%`, `$` -> `$$`, quoted C-style when needed."""
    escaped = word.replace("%", "%%").replace("$", "$$")
    if escaped and _SAFE.match(escaped):
        return escaped
    escaped = escaped.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def exec_start(argv: Sequence[str]) -> str:
    """The ExecStart= value for an argv list (the first word must be an absolute path)."""
    if not argv or not argv[0].startswith("/"):
        raise ValueError(f"systemd needs an absolute executable path, got {argv[:1]!r}")
    return " ".join(quote_exec_word(w) for w in argv)


def env_file(env: Mapping[str, str]) -> str:
    """EnvironmentFile= content: KEY="value" lines, sorted, values escaped for systemd."""
    lines = []
    for key in sorted(env):
        value = str(env[key]).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        lines.append(f'{key}="{value}"')
    return "\n".join(lines) + ("\n" if lines else "")
