"""`tilepd capacity FILE`: how many decode nodes a load needs, from live metrics or a stated load.

Exit codes (tilepd/contracts/exit_codes.py): 0 estimate printed (with --check: the current pool meets
the targets), 1 no pool size within reach meets the targets (said why), 2 bad options, 3 invalid topology, 4 topology unreadable, or a /metrics answer
that lacks what the estimate needs (named), 7 a /metrics endpoint did not answer (URL named),
or with --check the current pool misses a target.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from tilepd.contracts.exit_codes import ExitCode

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _fmt_s(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v * 1e3:.0f}ms" if v < 10 else f"{v:.1f}s"


def _pct(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{100 * v:.2f}%" if v < 0.1 else f"{100 * v:.1f}%" if v < 0.995 else f"{100 * v:.0f}%"


def _pair(f: str, s: str) -> str:
    """formula/simulation, the unit once when both share it."""
    for unit in ("ms", "%", "s"):
        if f.endswith(unit) and s.endswith(unit) and f[:-len(unit)][-1:].isdigit() and s[:-len(unit)][-1:].isdigit():
            return f"{f[:-len(unit)]}/{s}"
    return f"{f}/{s}"


def _fail(code: ExitCode, message: str) -> typer.Exit:
    err.print(f"[red]{message}[/]", highlight=False)
    return typer.Exit(int(code))


def _stated_load(topo, rps: float, prompt_tokens: int, output_tokens: int, ms_per_token: float | None,  # noqa: ANN001, ANN202
                 prefill_ms: float | None, service_cv: float, notes: list[str]):
    """The stated load, and the prefill fit it used (None with --prefill-ms)."""
    from tilepd.capacity import sources
    from tilepd.capacity.estimate import Load
    from tilepd.capacity.simulate import GammaTimes

    if ms_per_token is None:
        urls = [f"http://{d.address}:{d.http_port}/metrics" for d in topo.decode]
        scrapes = [_scrape_or_exit(u) for u in urls]
        per_token = sources.seconds_per_token(scrapes)
        if per_token is None:
            raise _fail(ExitCode.INPUT, f"the decode nodes ({', '.join(urls)}) have decoded no token yet: give --ms-per-token")
        notes.append(f"decode time per token {per_token * 1e3:.2f} ms: measured on {len(urls)} decode node(s) since they started")
    else:
        per_token = ms_per_token / 1e3
    fitted = None
    if prefill_ms is None:
        fitted = _prefill_fit(topo, prompt_tokens)
        prefill_s = fitted.seconds(prompt_tokens)
        notes.append(f"prefill {prefill_s * 1e3:.1f} ms for {prompt_tokens} prompt tokens: {fitted.describe()} (probes on the prefill "
                     "host, its first request left out; KV transfer, convert and inject not included)")
    else:
        prefill_s = prefill_ms / 1e3
    mean = prefill_s + output_tokens * per_token
    return Load(rps, GammaTimes(mean, service_cv), topo.all_routers[0].queue_timeout_s,
                f"stated: {rps:g} req/s, {prompt_tokens} prompt + {output_tokens} output tokens"), fitted


def _prefill_fit(topo, prompt_tokens: int):  # noqa: ANN001, ANN202 - returns PrefillFit
    """The prefill time as fixed + per-token parts, from probe prompts on the first prefill host (tilepd/capacity/prefill_fit.py)."""
    import httpx

    from tilepd.auth import vllm_auth_header
    from tilepd.capacity import prefill_fit

    p = topo.prefill[0]
    base = f"http://{p.address}:{p.port}"
    secret = _vllm_secret(topo)

    def complete(ids: list[int]) -> None:
        try:
            r = httpx.post(f"{base}/v1/completions", json={"model": topo.model.served_name, "prompt": ids, "max_tokens": 1, "temperature": 0},
                           headers=vllm_auth_header(secret), timeout=600)
        except httpx.HTTPError as exc:
            raise _fail(ExitCode.UNHEALTHY, f"prefill {base} did not answer a probe prompt: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise _fail(ExitCode.INPUT, f"prefill {base} refused a probe prompt: {r.status_code} {r.text[:300]}; give --prefill-ms")

    lengths = prefill_fit.probe_lengths(prompt_tokens, topo.model.max_seq_len)
    err.print(f"timing {len(lengths)} probe prompts ({', '.join(str(n) for n in sorted(set(lengths)))} tokens) on prefill {base} ...",
              highlight=False)
    samples, dropped = prefill_fit.probe(lambda: _scrape_or_exit(f"{base}/metrics"), complete, lengths)
    if not samples:
        raise _fail(ExitCode.INPUT, f"prefill {base}: no probe could be told apart from other traffic ({dropped} dropped): "
                    "give --prefill-ms")
    return prefill_fit.fit(samples)


def _vllm_secret(topo) -> bytes | None:  # noqa: ANN001
    """The deployment secret every vLLM of the deployment derives its API key from: the prefill host's secret file when
    the host is this machine, else `$TILEPD_DEPLOYMENT_SECRET` (None: the deployment was started without one)."""
    from tilepd.auth import SecretFileError
    from tilepd.deploy.drain import env_secret, secret_from
    from tilepd.plan import build_plan
    from tilepd.plan.vllm_args import SECRET_FILE_ENV

    plan = build_plan(topo)
    prefill = next(s for h in plan.hosts for s in h.services if s.role == "prefill")
    host = next(h for h in plan.hosts if prefill in h.services)
    path = prefill.env.get(SECRET_FILE_ENV)
    try:
        if host.local:
            return secret_from(Path(path)) if path else None
        return env_secret(f"the prefill's secret file is on {host.name}")
    except SecretFileError as exc:
        raise _fail(ExitCode.INPUT, f"cannot authenticate the probe prompts to the prefill: {exc}; or give --prefill-ms") from None


def _scrape_or_exit(url: str):  # noqa: ANN202 - returns Scrape
    from tilepd.capacity import sources

    try:
        return sources.scrape(url)
    except sources.MetricsUnreachable as exc:
        raise _fail(ExitCode.UNHEALTHY, f"metrics endpoint did not answer: {exc}") from None
    except sources.MetricsInvalid as exc:
        raise _fail(ExitCode.INPUT, str(exc)) from None


def _live_load(topo, window_s: float, notes: list[str]):  # noqa: ANN001, ANN202 - returns (Load, RouterLoad)
    """The load every router saw over one window (several routers over the same nodes: their counts summed)."""
    from tilepd.capacity import sources
    from tilepd.capacity.busy import busy_model
    from tilepd.capacity.estimate import Load

    routers = topo.all_routers
    urls = [f"http://{r.address}:{r.port}/metrics" for r in routers]
    before = [_scrape_or_exit(u) for u in urls]
    err.print(f"reading {', '.join(urls)} for {window_s:g} s ...", highlight=False)
    time.sleep(window_s)
    after = [_scrape_or_exit(u) for u in urls]
    loads = []
    for url, b, a in zip(urls, before, after):
        try:
            loads.append(sources.router_load(b, a, window_s))
        except sources.MetricsInvalid as exc:
            raise _fail(ExitCode.INPUT, f"{url}: {exc}") from None
    live = loads[0] if len(loads) == 1 else sources.combined(loads)
    notes.extend(live.notes)
    where = ", ".join(urls)
    if live.arrivals <= 0 or live.service.count <= 0:
        raise _fail(ExitCode.INPUT, f"{where}: no request reached the decode-node queue in {window_s:g} s "
                    "(nothing to measure): use a longer --window, or state the load with --rps")
    notes.append("arrivals taken as Poisson (the router does not record inter-arrival times)")
    by_busy, busy_notes = busy_model(live.busy_levels, live.alone_holds)
    notes.extend(busy_notes)
    names = ", ".join(f"{r.name} {r.address}:{r.port}" if len(routers) > 1 else f"{r.address}:{r.port}" for r in routers)
    source = f"live: router{'s' if len(routers) > 1 else ''} {names}, {window_s:g} s window, {live.arrivals:g} requests"
    return Load(live.rate, live.service.distribution(), routers[0].queue_timeout_s, source, by_busy), live


def _finite(v: float) -> float | None:
    """JSON has no NaN: an undefined figure (no lease to measure it on) is null."""
    return v if math.isfinite(v) else None


def _table(est, live, current: int) -> Table:  # noqa: ANN001
    t = Table(title="decode pool (formula/simulation)", title_justify="left")
    for name in ("nodes", "util", "P(wait)", "p99 wait", "429+fallb.", "ok", ""):
        t.add_column(name, justify="right" if name in ("nodes", "util", "P(wait)", "p99 wait", "429+fallb.") else "left", no_wrap=True)
    if live is not None:
        w = live.wait
        t.add_row(str(current), _pct(live.measured_utilisation(current)), _pct(w.fraction_above(0.0005)),
                  _fmt_s(w.quantile(0.99)), _pct(live.busy_fraction), "", "measured", style="cyan")
    for r in est.rows:
        f, s = r.formula, r.simulation
        mark = ", ".join(m for m, on in (("now", r.nodes == current), ("needed", r.nodes == est.needed)) if on)
        t.add_row(str(r.nodes), _pair(_pct(f.utilisation), _pct(s.utilisation)), _pair(_pct(f.p_wait), _pct(s.p_wait)),
                  _pair(_fmt_s(f.p99_wait_s), _fmt_s(s.p99_wait_s)), _pair(_pct(f.p_timeout), _pct(s.p_timeout)),
                  "[green]yes[/]" if r.meets(est.targets) else "[red]no[/]", mark)
    return t


def capacity(
    topology: Optional[Path] = typer.Argument(None, help="Topology file (default: the bundled local.yaml).", show_default=False),
    rps: Optional[float] = typer.Option(None, "--rps", min=0.0, help="Stated load: requests/s to the low-latency pool. Without it, the load is read live from the router."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", min=1, help="Stated load: prompt tokens per request."),
    output_tokens: Optional[int] = typer.Option(None, "--output-tokens", min=1, help="Stated load: output tokens per request (required with --rps)."),
    ms_per_token: Optional[float] = typer.Option(None, "--ms-per-token", min=0.0, help="Stated load: decode time per token; default measured on the decode nodes' /metrics."),
    prefill_ms: Optional[float] = typer.Option(None, "--prefill-ms", min=0.0, help="Stated load: time a node is held before its first token (prefill, KV transfer, inject); default fitted (fixed + per prompt token) on probe prompts tilepd times on the first prefill host (max_tokens 1, no decode node)."),
    service_cv: float = typer.Option(0.0, "--service-cv", min=0.0, help="Stated load: coefficient of variation of the service time (0: every request the same lengths)."),
    target_p99_wait_s: float = typer.Option(0.1, "--target-p99-wait-s", min=0.0, help="Target p99 wait for a decode node (of the requests served)."),
    target_fallback: float = typer.Option(0.01, "--target-fallback", min=0.0, max=1.0, help="Target share of requests that wait out the queue timeout (429, or the native pool)."),
    window_s: float = typer.Option(60.0, "--window", min=1.0, help="Live: seconds between the two scrapes of the router's /metrics."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Current pool size (default: the topology's decode nodes)."),
    sim_requests: int = typer.Option(100_000, "--sim-requests", min=1000, max=2_000_000, help="Requests per simulation run."),
    seed: int = typer.Option(0, "--seed", help="Seed of the simulation."),
    check: bool = typer.Option(False, "--check", help="Exit 7 when the current pool misses a target."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
) -> None:
    """How many batch=1 decode nodes the load needs for a target p99 queue wait and fallback rate.

    Each decode node serves one request at a time, so the pool is a multi-server queue whose service time is the whole request on the node. Erlang C with the router's queue timeout and a service-time-CV correction gives the figures; a seeded simulation with the measured (or stated) service-time distribution checks them. When the live service time depends on how many nodes are busy (nodes sharing a host), both use it per busy level. See docs/CAPACITY.md.
    """
    from tilepd.cli.deploy_cmds import _topology_arg
    from tilepd.topology import TopologyError, TopologyFileError, load_topology

    file = _topology_arg(topology)
    try:
        topo = load_topology(file)
    except TopologyFileError as e:
        raise _fail(ExitCode.INPUT, str(e)) from None
    except TopologyError as e:
        err.print(f"[red]{file}: invalid topology[/]\n{e}", highlight=False)
        raise typer.Exit(int(ExitCode.INVALID)) from None
    from tilepd.capacity.estimate import Targets, estimate

    if target_fallback <= 0:
        raise typer.BadParameter("must be > 0 (no pool size makes a timeout impossible, only rare)", param_hint="--target-fallback")
    notes: list[str] = []
    live = fitted = None
    if rps is not None:
        if rps <= 0:
            raise typer.BadParameter("must be > 0", param_hint="--rps")
        if output_tokens is None:
            raise typer.BadParameter("is required with --rps", param_hint="--output-tokens")
        load, fitted = _stated_load(topo, rps, prompt_tokens, output_tokens, ms_per_token, prefill_ms, service_cv, notes)
    else:
        stated = [n for n, v in (("--output-tokens", output_tokens), ("--ms-per-token", ms_per_token), ("--prefill-ms", prefill_ms)) if v is not None]
        if stated:
            raise typer.BadParameter(f"{', '.join(stated)} describe a stated load: give --rps too (or drop them to read the live load)", param_hint="--rps")
        load, live = _live_load(topo, window_s, notes)
    current = nodes or len(topo.decode)
    if live is not None and live.nodes_in_rotation is not None and live.nodes_in_rotation != current:
        notes.append(f"the router has {live.nodes_in_rotation} of {len(topo.decode)} decode nodes in rotation now")
    try:
        est = estimate(load, Targets(target_p99_wait_s, target_fallback), current, sim_requests=sim_requests, seed=seed)
    except ValueError as exc:  # e.g. no pool size within reach meets the targets
        raise _fail(ExitCode.ERROR, f"no estimate: {exc}") from None
    ok = est.row(current).meets(est.targets)
    if as_json:
        out = est.as_dict()
        out["notes"] = notes
        if fitted is not None:
            out["prefill"] = {"seconds": fitted.seconds(prompt_tokens), "prompt_tokens": prompt_tokens, "fixed_s": fitted.fixed_s,
                              "per_token_s": fitted.per_token_s, "requests": fitted.requests, "lengths": list(fitted.lengths)}
        if live is not None:
            w = live.wait
            out["measured"] = {"window_s": live.window_s, "rate_per_s": live.rate, "routes": live.routes, "leased": live.leased,
                               "busy_429": live.busy_429, "busy_fallback": live.busy_fallback, "busy_fraction": live.busy_fraction,
                               "utilisation": live.measured_utilisation(current), "p_wait": w.fraction_above(0.0005),
                               "p99_wait_s": w.quantile(0.99), "service_source": live.service_source,
                               "nodes_in_rotation": live.nodes_in_rotation,
                               "busy_levels": ({k: {"seconds": b.seconds, "releases": b.releases, "mean_s": b.mean_service_s}
                                                for k, b in live.busy_levels.items()} if live.busy_levels is not None else None),
                               "alone_holds": ({"releases": live.alone_holds.releases, "mean_s": _finite(live.alone_holds.mean_s),
                                                "cv": _finite(live.alone_holds.cv)} if live.alone_holds is not None else None)}
        typer.echo(json.dumps(out, indent=2, allow_nan=False, default=lambda v: None))
    else:
        svc = load.service
        console.print(f"[bold]load[/] {load.source}", highlight=False)
        console.print(f"  {load.rate:.3g} req/s x service {svc.describe()} = {load.rate * svc.mean:.3g} erlangs; "
                      f"queue timeout {load.timeout_s:g} s; targets: p99 wait <= {_fmt_s(target_p99_wait_s)}, "
                      f"429/fallback <= {_pct(target_fallback)}", highlight=False)
        model = ("state-dependent (service time by the busy nodes: " + load.by_busy.describe() + ")" if load.by_busy is not None
                 else "independent nodes (M/G/c)")
        console.print(f"  model: {model}", highlight=False)
        console.print(_table(est, live, current))
        verdict = "[green]meets the targets[/]" if ok else "[red]misses the targets[/]"
        console.print(f"now: {current} decode node(s), {verdict}; needed: [bold]{est.needed}[/] "
                      f"(formula alone: {est.needed_formula})", highlight=False)
        for n in notes:
            console.print(f"[dim]note: {n}[/]", highlight=False)
    if check and not ok:
        raise typer.Exit(int(ExitCode.UNHEALTHY))


def register(app: typer.Typer) -> None:
    app.command("capacity")(capacity)
