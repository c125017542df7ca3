"""Checks across hosts: what every host must agree on, compared on the controller after each host answered.

- `checkpoint-identity`: the checkpoint at `model.hf_path` on every host that reads it (prefill, native decode,
  decode nodes converting it, the router's tokenizer) and the source identity recorded in each decode host's
  converted weights are one deployment fingerprint (tilepd.contracts.fingerprint). Two hosts with other checkpoints
  of one architecture pass every other check and then serve other tokens; the decode nodes would refuse the
  prefill's hello (RB-fingerprint-mismatch), so `doctor` says so before `up`.
- `vllm-release`: with a native pool, every prefill and native decode interpreter runs the same vLLM release:
  NIXL's handshake hashes the vLLM version (0.33+), so a mixed pair would refuse each transfer later, with a worse
  message.

As elsewhere here, `evaluate_*` are pure and `gather` runs the commands through a Probe per host.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from tilepd.doctor.checks_host import _VERSIONS
from tilepd.doctor.expect import HostExpect
from tilepd.doctor.probe import Probe, first_line
from tilepd.doctor.result import Finding, ok, skip
from tilepd.topology import Topology
from tilepd.weights.manifest import MANIFEST

IDENTITY_TIMEOUT_S = 600.0  # sampled reads of a large checkpoint on a cold disk
VLLM_ROLES = ("prefill", "native_decode")


@dataclass
class HostFacts:
    """What one host said: the identity of its checkpoint and of its converted weights' source, its vLLM releases."""

    host: str
    roles: list[str]
    checkpoint: dict[str, Any] | None = None  # {"id", parts...} or {"error": ...}; None: the host reads no checkpoint
    weights_source: dict[str, Any] | None = None  # the manifest's source_identity with its id, {"error"}, or None
    vllm: dict[str, str | None] = field(default_factory=dict)  # role -> the vLLM release its interpreter has (None: none)


def _identity_json(res_stdout: str) -> dict[str, Any]:
    try:
        data = json.loads(res_stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": first_line(res_stdout) or "no answer"}
    return data if isinstance(data, dict) else {"error": str(data)[:200]}


def gather(probe: Probe, exp: HostExpect, topo: Topology) -> HostFacts:
    facts = HostFacts(exp.host.name, list(exp.host.roles))
    python = exp.host.environments[0].python if exp.host.environments else "python3"
    if exp.hf_needed and set(exp.host.roles) & {"prefill", "native_decode", "decode"}:
        res = probe.sh(f"{shlex.quote(python)} -m tilepd.contracts.fingerprint {shlex.quote(topo.model.hf_path)}",
                       timeout_s=IDENTITY_TIMEOUT_S)
        facts.checkpoint = _identity_json(res.stdout) if res.stdout.strip() else {"error": first_line(res.stderr) or f"exit {res.rc}"}
        if topo.model.generate_tiny and "no config.json" in str(facts.checkpoint.get("error", "")):
            facts.checkpoint = None  # `up` generates it (the same bytes on every host): nothing to compare yet
    if exp.decode_weights:
        res = probe.sh(f"cat {shlex.quote(topo.model.weights_path + '/' + MANIFEST)}")
        if res.rc == 0:
            try:
                recorded = json.loads(res.stdout).get("source_identity")
            except (json.JSONDecodeError, AttributeError):
                recorded = None
            facts.weights_source = _with_id(recorded) if recorded else {"error": "its manifest records no source identity"}
    for svc in exp.daemons:
        if svc.role in VLLM_ROLES and svc.role not in facts.vllm:
            out = probe.sh(f"{shlex.quote(svc.python)} -c {shlex.quote(_VERSIONS)}", timeout_s=60)
            try:
                facts.vllm[svc.role] = json.loads(out.stdout.strip().splitlines()[-1]).get("vllm")
            except (json.JSONDecodeError, IndexError, AttributeError):
                facts.vllm[svc.role] = None
    return facts


def _with_id(recorded: dict[str, Any]) -> dict[str, Any]:
    from tilepd.contracts.fingerprint import CheckpointIdentity

    try:
        return {**recorded, "id": CheckpointIdentity.model_validate(recorded).id}
    except ValueError as exc:
        return {"error": f"unreadable source_identity: {exc}"[:200]}


def evaluate_checkpoint_identity(facts: list[HostFacts]) -> list[Finding]:
    """One finding per host that reads the checkpoint or holds converted weights: ok when its identity is the one the
    first prefill host (else the first host) has, else a required failure naming both and the parts that differ."""
    seen = [(f, "checkpoint", f.checkpoint) for f in facts if f.checkpoint is not None] + \
           [(f, "converted weights' source", f.weights_source) for f in facts if f.weights_source is not None]
    readable = [(f, what, ident) for f, what, ident in seen if "error" not in ident]
    if not seen:
        return []
    ref = next(((f, what, i) for f, what, i in readable if "prefill" in f.roles and what == "checkpoint"), readable[0] if readable else None)
    out = []
    for f, what, ident in seen:
        if "error" in ident:
            verdict = "warn" if what != "checkpoint" else "fail"
            out.append(Finding("checkpoint-identity", f.host, verdict, f"{what}: {ident['error']}",
                               "`tilepd up` records the source identity without converting again" if what != "checkpoint"
                               else "check model.hf_path on this host (config.json and *.safetensors)", "RB-fingerprint-mismatch",
                               required=what == "checkpoint"))
            continue
        assert ref is not None
        rf, rwhat, rident = ref
        diff = [k for k in ("weights", "index", "config", "tokenizer") if ident.get(k) != rident.get(k)]
        if not diff:
            out.append(ok("checkpoint-identity", f.host, f"{what} {ident['id']}" + ("" if f is rf and what == rwhat else
                                                                                    f", as {rwhat} on {rf.host}")))
            continue
        out.append(Finding("checkpoint-identity", f.host, "fail",
                           f"{what} {ident['id']} differs from the {rwhat} {rident['id']} on {rf.host} in {', '.join(diff)}",
                           "copy the one checkpoint to model.hf_path on every host (then `tilepd up` converts again where the "
                           "decode weights came from another)", "RB-fingerprint-mismatch"))
    return out


def evaluate_vllm_release(facts: list[HostFacts], native_pool: bool) -> list[Finding]:
    """With a native pool: one finding per prefill / native decode host, failed when the releases differ."""
    if not native_pool:
        return []
    seen = [(f, role, v) for f in facts for role, v in f.vllm.items()]
    versions = {v for _, _, v in seen if v}
    if not seen:
        return []
    listing = ", ".join(f"{f.host} ({role}) {v or 'none'}" for f, role, v in seen)
    if len(versions) <= 1:
        return [ok("vllm-release", f.host, f"vLLM {v} for {role}, as on every prefill and native decode host") if v else
                skip("vllm-release", f.host, f"no vLLM in the {role} interpreter yet (`vllm-present` says why)") for f, role, v in seen]
    return [Finding("vllm-release", f.host, "fail",
                    f"the prefill and native decode pools run different vLLM releases: {listing}",
                    "install one vLLM release into every prefill and native decode interpreter (NIXL refuses a pair of two "
                    "releases at each transfer)", "RB-upgrade") for f, _, _ in seen]
