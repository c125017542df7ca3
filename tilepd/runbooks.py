"""The ids of the on-call runbooks (docs/runbooks/RB-*.md), for the errors and log lines that name them.

Every error tilepd prints for a runbook's failure mode ends with `see(id)`, every such log line carries
`tag(id)`, and HTTP errors carry the id as the error object's `runbook` field: the operator reads the id
where the failure shows and runs `tilepd runbook ID`. Sites pass the literal id (`see("RB-kv-timeout")`)
so tests/test_runbook_refs.py can check both directions: every id in the code has a runbook, every
runbook is named by an error site. Stdlib only: the router, the decode node and operator verbs import it.
The text of the runbooks is read by tilepd.doctor.runbooks (checkout or wheel).
"""

from __future__ import annotations

# id -> title: the first line of docs/runbooks/<id>.md after "# <id>: " (a test keeps them equal)
RUNBOOKS: dict[str, str] = {
    "RB-accept-failing": "a decode node's port accepts no connection (out of fds or buffers)",
    "RB-api-key-rotation": "rotate the router's API key",
    "RB-decode-down": "a decode node is down or stuck busy",
    "RB-divergence": "a decode node's tokens diverge from the prefill's (canary or divergence watch)",
    "RB-fingerprint-mismatch": "the prefill serves another checkpoint than a decode node's weights",
    "RB-host-unreachable": "a host cannot be reached during `up`",
    "RB-kv-timeout": "KV transfers time out",
    "RB-native-fallback": "many low-latency requests fall back to the native pool",
    "RB-orphaned-ports": "orphaned processes hold ports (or GPU memory)",
    "RB-prefill-restarted": "a prefill instance restarted under its decode nodes",
    "RB-protocol-mismatch": "transport or protocol mismatch between prefill and decode",
    "RB-router-429": "the router answers 429 (decode pool busy)",
    "RB-upgrade": "upgrade tilepd or vLLM without dropping traffic",
    "RB-weights-manifest": "converted weights do not match the topology",
}


class UnknownRunbook(KeyError):
    """A code site names a runbook id that does not exist (a typo the tests should have caught)."""


def _known(runbook_id: str) -> str:
    if runbook_id not in RUNBOOKS:
        raise UnknownRunbook(f"no runbook {runbook_id!r}; known: {', '.join(RUNBOOKS)}")
    return runbook_id


def see(runbook_id: str) -> str:
    """The suffix an error message ends with: ` (runbook RB-<id>: tilepd runbook RB-<id>)`."""
    return f" (runbook {_known(runbook_id)}: tilepd runbook {runbook_id})"


def cite(message: str, runbook_id: str) -> str:
    """`message` ending with `see(runbook_id)`, unless it already names that runbook."""
    return message if _known(runbook_id) in message else message + see(runbook_id)


def tag(runbook_id: str) -> str:
    """The key=value field a log line carries: `runbook=RB-<id>`."""
    return f"runbook={_known(runbook_id)}"
