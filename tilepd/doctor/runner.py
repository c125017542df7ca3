"""Run every doctor check on every host of a deployment (hosts in parallel, checks in order per host)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tilepd.deploy import host_keys
from tilepd.deploy.remote import HostKeyChanged, HostShell, HostUnreachable
from tilepd.doctor import checks_balancer as B
from tilepd.doctor import checks_fleet as F
from tilepd.doctor import checks_host as H
from tilepd.doctor import checks_hw as W
from tilepd.doctor import checks_live as L
from tilepd.doctor.expect import HostExpect, host_expectations
from tilepd.doctor.probe import Probe
from tilepd.doctor.result import Finding, ok
from tilepd.plan import Plan
from tilepd.topology import Topology


def check_host(exp: HostExpect, topo: Topology, plan: Plan, *, known_hosts: Path | None = None, live: bool = True) -> list[Finding]:
    """All checks of one host; an unreachable host gives one failed `ssh` finding."""
    shell = HostShell(exp.host, known_hosts=known_hosts)
    probe = Probe(shell)
    h = exp.host.name
    try:
        out: list[Finding] = []
        if not exp.host.local:
            probe.sh("true")  # connect first: an unreachable host is one finding, not one per check
            out.append(ok("ssh", h, f"{exp.host.ssh.user or 'current user'}@{exp.host.address}:{exp.host.ssh.port}"))
            out.append(_host_key(shell))
        out += H.run_python(probe, exp)
        out += W.run_gpus(probe, exp)
        moves_kv = plan.rdma and bool({"prefill", "decode", "native_decode"} & set(exp.host.roles))  # the router moves no KV
        if moves_kv:
            out += W.run_rdma_all(probe, exp, transport=plan.transport, services_mode=plan.services_mode)
        out.append(W.evaluate_memlock(exp, probe.sh("ulimit -l"), rdma=moves_kv, services_mode=plan.services_mode))
        states = H.proc_states(probe, exp)
        out += H.run_ports(probe, exp, states)
        manifest = H.run_manifest(probe, exp, topo)
        checkpoint = H.run_checkpoint(probe, exp, topo)
        out += [f for f in (checkpoint, manifest) if f is not None]
        out += H.run_disk(probe, exp, topo, manifest_present=manifest is not None and manifest.verdict != "warn")
        out.append(H.run_clock(probe, exp))
        if "balancer" in exp.host.roles:
            out += B.run_balancer(probe, exp, plan, states if live else {})
        if live:
            out += L.run_live(exp, states)
        if any(st.get("running") for st in states.values()):
            for f in out:  # this deployment's own services hold GPU memory while they run
                if f.check == "gpu-free-memory" and f.verdict == "fail":
                    f.verdict, f.required = "warn", False
                    f.evidence += " (this deployment's services run here)"
        return out
    except HostKeyChanged as e:
        fix = "if the host was reinstalled or its key rotated on purpose, check the new key and re-trust it: " + host_keys.retrust_command(
            shell.known_hosts or Path("known_hosts"), exp.host.address, exp.host.ssh.port)
        return [Finding("ssh-host-key", h, "fail", f"CHANGED: the host offers {e.offered}, {shell.known_hosts} recorded {e.recorded} at first "
                        "contact; refused before authenticating", fix, "RB-host-unreachable")]
    except HostUnreachable as e:
        return [Finding("ssh", h, "fail", e.reason, f"check the address, `ssh -p {exp.host.ssh.port} {exp.host.ssh.user or '$USER'}@{exp.host.address}`, "
                        "the key and sshd on the host", "RB-host-unreachable")]
    finally:
        shell.close()


def _host_key(shell: HostShell) -> Finding:
    """The host's SSH key against the deployment's known_hosts (trust on first use; a changed key never gets here)."""
    seen = "recorded now (first contact)" if shell.host_key_status == "recorded" else "matches the one recorded"
    return ok("ssh-host-key", shell.host.name, f"{shell.host_key_fingerprint}: {seen} in {shell.known_hosts}")


def _fleet_facts(exp: HostExpect, topo: Topology, known_hosts: Path | None) -> F.HostFacts | None:
    """What a host says for the checks across hosts (None: it stopped answering since its own checks)."""
    shell = HostShell(exp.host, known_hosts=known_hosts)
    try:
        return F.gather(Probe(shell), exp, topo)
    except (HostUnreachable, HostKeyChanged):
        return None
    finally:
        shell.close()


def run_doctor(topo: Topology, plan: Plan, *, hosts: list[str] | None = None, known_hosts: Path | None = None,
               live: bool = True, environ: dict[str, str] | None = None) -> list[Finding]:
    """Findings of every selected host (plan order), then the controller-side checks."""
    exps = [e for e in host_expectations(topo, plan) if hosts is None or e.host.name in hosts]
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(exps)))) as pool:
        per_host = list(pool.map(lambda e: check_host(e, topo, plan, known_hosts=known_hosts, live=live), exps))
    out = [f for fs in per_host for f in fs]
    reachable = [e for e, fs in zip(exps, per_host) if not any(f.check in ("ssh", "ssh-host-key") and f.verdict == "fail" for f in fs)]
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(reachable)))) as pool:
        facts = [f for f in pool.map(lambda e: _fleet_facts(e, topo, known_hosts), reachable) if f is not None]
    out += F.evaluate_checkpoint_identity(facts)
    out += F.evaluate_vllm_release(facts, native_pool=bool(topo.native_decode))
    selected = {e.host.name for e in exps}
    out += [f for f in H.evaluate_api_key(plan, os.environ if environ is None else environ) if f.host in selected]
    return out
