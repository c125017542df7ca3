"""`tilepd status`: what runs where, is it healthy, and does it match the topology.

Run state comes from each host (the supervisor's state file in process mode, systemd
in systemd mode), read through `python -m tilepd.deploy.proc status` locally or over
SSH; health and live figures come from the services' HTTP endpoints; drift compares
the config hash and tilepd version each service runs with what the topology renders now.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from tilepd.deploy import probes
from tilepd.deploy.inventory import spec_file
from tilepd.deploy.remote import HostShell, HostUnreachable
from tilepd.plan import HostPlan, Plan, Service


@dataclass
class ServiceStatus:
    host: str
    service: str
    role: str
    run: str  # running | stopped | crashed (orphans) | not deployed | unreachable | unknown
    pid: int | None = None
    # systemd mode: how often systemd restarted the service on its own (Restart=on-failure) since `up` started it
    restarts: int | None = None
    healthy: bool = False
    health: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    drift: list[str] = field(default_factory=list)
    fingerprint: dict[str, Any] | None = None  # with fingerprints: tilepd.deploy.fingerprints.summary (or {"error": ...})

    @property
    def ok(self) -> bool:
        return self.run == "running" and self.healthy and not self.drift

    @property
    def runbook(self) -> str | None:
        """The on-call runbook of what is wrong with this service (None when it is fine or none applies)."""
        if self.run.startswith("crashed"):
            return "RB-orphaned-ports"  # main process gone, its group still holds ports / GPU memory
        if self.run == "unreachable":
            return "RB-host-unreachable"
        if any(d.startswith("tilepd ") for d in self.drift):
            return "RB-upgrade"  # the service runs another tilepd than the controller
        if any(d.startswith("fingerprint ") for d in self.drift):
            return "RB-fingerprint-mismatch"  # it serves another checkpoint than the first prefill
        if self.run in ("running", "stopped") and not self.ok and not self.drift and self.health != "draining":  # drained on purpose
            return {"decode": "RB-decode-down", "prefill": "RB-prefill-restarted"}.get(self.role)
        return None


def _host_states(plan: Plan, host: HostPlan, services: list[Service], known_hosts: Path | None,
                 fingerprints: bool = False) -> dict[str, dict[str, Any]]:
    """service name -> proc status JSON (or {"run": reason}); with `fingerprints`, each service's fingerprint too."""
    shell = HostShell(host, known_hosts=known_hosts)
    out: dict[str, dict[str, Any]] = {}
    extra = ["--fingerprint"] if fingerprints else []
    try:
        for svc in services:
            try:
                res = shell.run([svc.python, "-m", "tilepd.deploy.proc", "status", "--spec", spec_file(host, svc), *extra])
            except HostUnreachable as e:
                return {s.name: {"run": "unreachable", "reason": e.reason} for s in services}
            try:
                data = json.loads(res.stdout.strip().splitlines()[-1])
            except (json.JSONDecodeError, IndexError):
                data = {"run": "unknown", "reason": (res.stderr or res.stdout).strip()[-300:]}
            if data.get("failed"):  # no spec file: `up` never deployed it here
                data = {"run": "not deployed"}
            out[svc.name] = data
    finally:
        shell.close()
    return out


def _one(plan: Plan, host: HostPlan, svc: Service, state: dict[str, Any]) -> ServiceStatus:
    if "run" in state:
        run = state["run"]
    else:
        # crashed: the main process died and others of its group hold on (`tilepd up` ends them and restarts)
        run = "running" if state.get("running") else ("crashed (orphans)" if state.get("orphans") else "stopped")
    st = ServiceStatus(host=host.name, service=svc.name, role=svc.role, run=run, pid=state.get("pid"), restarts=state.get("restarts"),
                       fingerprint=state.get("fingerprint"))
    st.healthy, st.health = probes.health(svc)
    if st.healthy or st.health == "draining":
        st.figures = probes.live_figures(svc)
        live = st.figures.get("fingerprint")
        if isinstance(live, dict) and live.get("id"):  # what the running node reports wins over its manifest
            st.fingerprint = live
    if run == "running":
        if state.get("config_hash") and state["config_hash"] != svc.config_hash:
            st.drift.append(f"config {str(state['config_hash'])[7:19]} != topology {svc.config_hash[7:19]}")
        if state.get("tilepd_version") and state["tilepd_version"] != plan.tilepd_version:
            st.drift.append(f"tilepd {state['tilepd_version']} != controller {plan.tilepd_version}")
    return st


def collect(plan: Plan, known_hosts: Path | None = None, fingerprints: bool = False) -> list[ServiceStatus]:
    """Status of every daemon in the plan (hosts read in parallel); with `fingerprints`, each one's deployment
    fingerprint (its host reads the checkpoint: seconds on a large one), and a drift entry for each that serves
    another checkpoint than the first prefill."""
    work = [(h, [s for s in h.services if s.kind == "daemon"]) for h in plan.hosts]
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(work)))) as pool:
        states = list(pool.map(lambda hw: _host_states(plan, hw[0], hw[1], known_hosts, fingerprints), work))
    rows = []
    for (host, services), host_states in zip(work, states):
        for svc in services:
            rows.append(_one(plan, host, svc, host_states.get(svc.name, {"run": "unknown"})))
    if fingerprints:
        note_fingerprint_drift(rows)
    return rows


def note_fingerprint_drift(rows: list[ServiceStatus]) -> None:
    """`fingerprint <id> != prefill <id>` on every prefill, decode or native row whose checkpoint is not the first
    prefill's (decode-side facts differ by design: only the checkpoint's id is compared)."""
    ref = next((r for r in rows if r.role == "prefill" and (r.fingerprint or {}).get("id")), None)
    if ref is None or ref.fingerprint is None:
        return
    want = ref.fingerprint["id"]
    for r in rows:
        got = (r.fingerprint or {}).get("id")
        if r.role in ("prefill", "decode", "native_decode") and got and got != want:
            r.drift.append(f"fingerprint {got} != prefill {ref.service} {want}")


def as_json(rows: list[ServiceStatus]) -> list[dict[str, Any]]:
    return [{**asdict(r), "ok": r.ok, "runbook": r.runbook} for r in rows]


def runbook_hint(rows: list[ServiceStatus]) -> str:
    """`; runbooks: RB-<id> (svc, ...), ... (tilepd runbook ID)` for the services a runbook covers, else ''."""
    by_book: dict[str, list[str]] = {}
    for r in rows:
        if r.runbook:
            by_book.setdefault(r.runbook, []).append(r.service)
    if not by_book:
        return ""
    return "; runbooks: " + ", ".join(f"{b} ({', '.join(s)})" for b, s in by_book.items()) + " (tilepd runbook ID)"


def figures_text(st: ServiceStatus) -> str:
    f = st.figures
    if not f:
        return ""
    if st.role == "decode":
        tps = f.get("tokens_per_s")
        parts = ["busy" if f.get("busy") else "idle", f"state {f.get('state')}"]
        if f.get("transfer_id"):
            parts.append(f"transfer {f['transfer_id']}")
        parts.append(f"last {tps:.1f} tok/s" if isinstance(tps, (int, float)) else "last -")
        parts.append(f"transfers {f.get('transfers_total')}")
        if f.get("drain_reason"):
            parts.append(f"drained: {f['drain_reason']}")
        return ", ".join(parts)
    if st.role in ("prefill", "native_decode"):
        return f"running {_num(f.get('running'))}, waiting {_num(f.get('waiting'))}"
    if st.role == "router":
        routes = " ".join(f"{k}={v}" for k, v in (f.get("routes") or {}).items()) or "none"
        return f"in-flight {_num(f.get('in_flight'))}, queued {_num(f.get('queued'))}, routes {routes}, 429s {f.get('rejected_429', 0)}"
    if st.role == "balancer":
        return "routers: " + (", ".join(f"{k} {v}" for k, v in (f.get("backends") or {}).items()) or "none")
    return json.dumps(f)


def fingerprint_text(st: ServiceStatus) -> str:
    """`<id> (<fact> <value>, ...)`, `unknown`, the error, or '' for a role without one."""
    fp = st.fingerprint
    if not fp:
        return ""
    if "error" in fp:
        return f"? {fp['error']}"
    facts = ", ".join(f"{k} {v}" for k, v in sorted((fp.get("facts") or {}).items()))
    return f"{fp.get('id')}" + (f" ({facts})" if facts else "")


def _num(v: Any) -> str:
    return "-" if v is None else str(int(v))


def short_figure(st: ServiceStatus) -> str:
    """One live figure per role that fits the 80-column table (the full set is under --wide / --json)."""
    f = st.figures
    if not f:
        return ""
    if st.role == "decode":
        tps = f.get("tokens_per_s")
        return f"{'busy' if f.get('busy') else 'idle'} {f'{tps:.1f}' if isinstance(tps, (int, float)) else '-'} tok/s"
    if st.role in ("prefill", "native_decode"):
        return f"run {_num(f.get('running'))} wait {_num(f.get('waiting'))}"
    if st.role == "router":
        return f"in {_num(f.get('in_flight'))} q {_num(f.get('queued'))} 429s {f.get('rejected_429', 0)}"
    if st.role == "balancer":
        return " ".join(f"{k} {v}" for k, v in (f.get("backends") or {}).items())
    return ""


def restarts_text(st: ServiceStatus) -> str:
    """` (N restarts)` when systemd restarted the service on its own (a crash it recovered from), else ''."""
    if not st.restarts:
        return ""
    return f" ({st.restarts} restart{'' if st.restarts == 1 else 's'})"


def state_text(st: ServiceStatus) -> str:
    """The run state in one word or two: `crashed (orphans)` -> `crashed`, running with drift -> `drift`;
    `running (1 restart)` after systemd brought a crashed service back."""
    if st.run.startswith("crashed"):
        return "crashed"
    return ("drift" if st.run == "running" and st.drift else st.run) + restarts_text(st)


def health_text(st: ServiceStatus) -> str:
    """`ok`, `draining`, an HTTP status, or `down` (the exception's name is under --wide); no health endpoint -> `-`."""
    if st.healthy:
        return "ok" if st.health.startswith("HTTP") else "-"
    return st.health if st.health.startswith("HTTP") or st.health == "draining" else "down"


def table(rows: list[ServiceStatus], *, wide: bool = False) -> Table:
    """The status table: one line per service within 80 columns (only the live figure is ever cut), or every detail with `wide`."""
    if wide:
        t = Table(title="tilepd status", title_justify="left")
        for col in ("host", "service", "role"):
            t.add_column(col, no_wrap=True)
        for col in ("run", "health", "live", "fingerprint", "drift"):
            t.add_column(col, overflow="fold")
        for r in rows:
            run = (f"[green]running[/] ({r.pid})" if r.run == "running" else f"[red]{r.run}[/]") + escape(restarts_text(r))
            health = f"[green]{r.health}[/]" if r.healthy else f"[red]{r.health}[/]"
            t.add_row(r.host, r.service, r.role, run, health, figures_text(r), escape(fingerprint_text(r)),
                      "[yellow]" + escape("; ".join(r.drift)) + "[/]" if r.drift else "")
        return t
    cells = [(r.host, r.service, state_text(r), health_text(r), short_figure(r)) for r in rows]
    t = Table(box=None, pad_edge=False, padding=(0, 1), title="tilepd status", title_justify="left", header_style="bold")
    for i, col in enumerate(("host", "service", "state", "health")):
        t.add_column(col, no_wrap=True, min_width=max([len(col), *(len(c[i]) for c in cells)]))
    t.add_column("live", no_wrap=True, overflow="ellipsis")
    for r, (host, service, state, health, live) in zip(rows, cells):
        color = "green" if r.run == "running" and not r.drift else ("yellow" if state.startswith("drift") else "red")
        t.add_row(escape(host), escape(service), f"[{color}]{escape(state)}[/]", f"[{'green' if r.healthy else ('yellow' if health == 'draining' else 'red')}]{escape(health)}[/]", escape(live))
    return t
