"""`tilepd trace REQUEST_ID`: one request's timeline, read back from the services' log lines (issue 17).

Three kinds of line carry it (all `key=value` fields):
- the router's per-request line, `req=<id> event=done|refused|prefill_failed|native_failed ... transfers=tx-.. timeline=..`
  (tilepd/router/timeline.py), and the request's other router lines (`event=node_fault`, `failover`, `node_silent`, ...);
- the decode node's `event=decode_done transfer_id=<tx> req=<id> ...` with its own phases (INTERFACES §4);
- the connector's `tilepd-connector role=worker event=staged|sent|failed ... transfer_id=<tx>` lines in the prefill
  (vLLM) log: staging (`extract_ms`, `window_ms`) and the send (`queued_ms`, `wire_ms`, `total_ms`).

The router's line is found by request id, the others by the transfer ids it names (and the node's by request id too).
Nothing here imports torch or vLLM: it is an operator verb.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FIELD = re.compile(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=(\S+)")
_STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?)")
FINAL_EVENTS = ("done", "refused", "prefill_failed", "native_failed")
NODE_KEYS = (("wait_ms", "kv_wait"), ("queue_ms", "node_queue"), ("convert_ms", "convert"), ("inject_ms", "inject"),
             ("decode_ms", "decode"), ("first_step_ms", "first_step"), ("transfer_ms", "transfer"), ("node_ms", "node_total"),
             ("tokens", "tokens"), ("tokens_per_s", "tokens_per_s"))
CONNECTOR_KEYS = ("extract_ms", "extract_total_ms", "window_ms", "queued_ms", "wire_ms", "total_ms", "bytes", "retries", "code", "message")


def fields(line: str) -> dict[str, str]:
    """The `key=value` fields of a log line (the first of a repeated key wins)."""
    out: dict[str, str] = {}
    for k, v in _FIELD.findall(line):
        out.setdefault(k, v)
    return out


def stamp(line: str) -> str | None:
    m = _STAMP.match(line.split(" | ", 1)[-1] if " | " in line[:80] else line)
    return m.group(1) if m else None


def _num(v: str | None) -> float | None:
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


@dataclass
class Trace:
    request_id: str
    router: dict[str, str] | None = None  # the final router line's fields
    router_line: str | None = None
    events: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (source, event, fields) in log order
    phases: dict[str, float] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)  # per transfer: the node's timings
    connector: list[dict[str, Any]] = field(default_factory=list)  # per transfer: staging and send
    sources: list[str] = field(default_factory=list)  # where lines were found

    @property
    def found(self) -> bool:
        return self.router is not None

    @property
    def transfers(self) -> list[str]:
        raw = (self.router or {}).get("transfers", "-")
        return [] if raw in ("-", "") else raw.split(",")

    def to_json(self) -> dict[str, Any]:
        r = self.router or {}
        total = _num(r.get("ms"))
        return {"request_id": self.request_id, "found": self.found, "event": r.get("event"), "route": r.get("route"),
                "reason": r.get("reason"), "status": r.get("status"), "outcome": r.get("outcome"), "node": r.get("node"),
                "fallback": r.get("fallback"), "retries": r.get("retries"), "failovers": r.get("failovers"),
                "total_ms": total, "ttft_ms": _num(r.get("ttft_ms")), "phases_ms": self.phases, "transfers": self.transfers,
                "nodes": self.nodes, "connector": self.connector, "trace_id": r.get("trace_id"),
                "events": [{"source": s, "event": e, **f} for s, e, f in self.events], "sources": self.sources,
                "router_line": self.router_line}


def parse_timeline(value: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in value.split(","):
        name, _, ms = item.partition(":")
        v = _num(ms)
        if name and v is not None:
            out[name] = out.get(name, 0.0) + v
    return out


def router_pass(request_id: str, lines: Iterable[tuple[str, str]]) -> Trace:
    """The router's lines of `request_id` ((source, line) pairs): the final line and the events before it."""
    tr = Trace(request_id)
    needle = f"req={request_id} "
    for source, line in lines:
        if needle not in line + " " or "tilepd-connector" in line:
            continue
        f = fields(line)
        if f.get("req") != request_id or "transfer_id" in f and f.get("event", "").startswith("decode_"):
            continue
        event = f.get("event", "?")
        tr.events.append((source, event, f))
        if source not in tr.sources:
            tr.sources.append(source)
        if event in FINAL_EVENTS and "timeline" in f:
            tr.router, tr.router_line = {**f, "stamp": stamp(line) or ""}, line
            tr.phases = parse_timeline(f["timeline"])
    return tr


def upstream_pass(tr: Trace, lines: Iterable[tuple[str, str]]) -> Trace:
    """The decode nodes' and connector's lines of the request's transfers."""
    wanted = set(tr.transfers)
    for source, line in lines:
        f = fields(line)
        tid = f.get("transfer_id")
        if "tilepd-connector" in line:
            if tid not in wanted or f.get("event") not in ("staged", "sent", "failed", "not_sent", "refused"):
                continue
            entry = next((c for c in tr.connector if c["transfer_id"] == tid), None)
            if entry is None:
                entry = {"transfer_id": tid, "source": source}
                tr.connector.append(entry)
            ev = f["event"]
            entry.setdefault("events", []).append(ev)
            for k in CONNECTOR_KEYS:
                if k in f:
                    entry[f"{ev}.{k}" if ev in ("staged",) else k] = _num(f[k]) if k not in ("code", "message") else f[k]
        elif f.get("event") == "decode_done" and (tid in wanted or f.get("req") == tr.request_id):
            entry = {"transfer_id": tid, "source": source, "finish": f.get("finish")}
            for key, name in NODE_KEYS:
                if key in f:
                    entry[name] = _num(f[key])
            tr.nodes.append(entry)
        else:
            continue
        if source not in tr.sources:
            tr.sources.append(source)
    order = {t: i for i, t in enumerate(tr.transfers)}
    tr.nodes.sort(key=lambda e: order.get(e["transfer_id"], len(order)))
    tr.connector.sort(key=lambda e: order.get(e["transfer_id"], len(order)))
    return tr


# -- reading a local folder of logs --------------------------------------------------------------------------------

def log_files(folder: Path) -> list[Path]:
    """`*.log` and their rotations (`*.log.1` ...) under `folder`, oldest rotation first so lines stay in order."""
    files = [p for p in folder.rglob("*") if p.is_file() and re.search(r"\.log(\.\d+)?$", p.name)]

    def key(p: Path) -> tuple[str, int]:
        m = re.search(r"\.log\.(\d+)$", p.name)
        base = str(p)[: m.start() + 4] if m else str(p)
        return base, -(int(m.group(1)) if m else 0)

    return sorted(files, key=key)


def read_lines(files: Iterable[Path], root: Path) -> Iterator[tuple[str, str]]:
    for p in files:
        name = str(p.relative_to(root)) if p.is_relative_to(root) else str(p)
        try:
            with p.open("r", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    yield name, line.rstrip("\n")
        except OSError:
            continue


def trace_folder(request_id: str, folder: Path) -> Trace:
    files = log_files(folder)
    tr = router_pass(request_id, read_lines(files, folder))
    if tr.found:
        upstream_pass(tr, read_lines(files, folder))
    return tr


# -- reading a deployment's logs on its hosts ---------------------------------------------------------------------

def _grep_argv(plan: Any, service: Any, needles: list[str]) -> list[str]:
    """A shell command printing the lines of one service's log (rotations oldest first) that hold any needle."""
    import shlex

    pattern = " ".join(f"-e {shlex.quote(n)}" for n in needles)
    if plan.services_mode == "systemd":
        return ["sh", "-c", f"journalctl --no-pager -o short-iso -u {shlex.quote(service.unit)} | grep -F {pattern}"]
    log = service.log_file
    files = " ".join(shlex.quote(f"{log}.{i}") for i in range(9, 0, -1)) + " " + shlex.quote(log)
    return ["sh", "-c", f"cat {files} 2>/dev/null | grep -F {pattern}"]


def trace_plan(request_id: str, plan: Any, *, known_hosts: Path | None = None) -> tuple[Trace, list[str]]:
    """The trace from a deployment's router, decode and prefill logs, wherever they run; also the sources that could not be read."""
    from tilepd.deploy.logs import select
    from tilepd.deploy.remote import HostShell, HostUnreachable

    problems: list[str] = []
    shells: dict[str, Any] = {}

    def grab(roles: tuple[str, ...], needles: list[str]) -> Iterator[tuple[str, str]]:
        for role in roles:
            for src in select(plan, role=role):
                shell = shells.setdefault(src.host.name, HostShell(src.host, known_hosts=known_hosts))
                try:
                    out = shell.run(_grep_argv(plan, src.service, needles))
                except HostUnreachable as e:
                    problems.append(f"{src.prefix}: unreachable: {e.reason}")
                    continue
                if out.rc not in (0, 1):  # grep: 1 = no match
                    problems.append(f"{src.prefix}: {out.stderr.strip()[-200:] or f'exit {out.rc}'}")
                for line in out.stdout.splitlines():
                    yield src.prefix, line

    try:
        tr = router_pass(request_id, grab(("router",), [f"req={request_id} "]))
        if tr.found:
            upstream_pass(tr, grab(("decode", "prefill"), [*tr.transfers, f"req={request_id} "]))
    finally:
        for s in shells.values():
            s.close()
    return tr, problems
