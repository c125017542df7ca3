"""The canary of a rolling restart: one real request through the prefill and the restarted decode node, before the
router leases it again.

A decode node that `up` restarts is drained first (tilepd/deploy/proc.py) and, since the node keeps its drained
state in its `drain_file`, starts again draining: healthy, but no lease. The supervisor on its host then sends the
canary the way the router sends a request: it reserves the node's slot (node API 2, renewed on a thread while the
canary runs), then a prefill (`max_tokens` 1) carrying the tilepd marker for this node, with a transfer id that
starts with CANARY_TRANSFER_PREFIX (the only transfer a draining node takes) and its token minted from the
deployment secret, then the decode of the next tokens on the node, greedy. The prefill then scores the node's
tokens (teacher-forced verification, tilepd.contracts.teacher_forced): each must be the prefill's top-1 or within
`margin_nats` of it. Only when both hold is the node undrained. Outcomes:

- `ok`: the node decoded the tokens and the prefill agrees with every one (`verdict` says how closely);
- `failed`: the node refused or failed the decode, or its tokens diverge from the prefill's (the first diverging
  position and both logprobs in the reason, runbook RB-divergence), or the prefill could not score them: the node
  stays drained and `up` fails;
- `skipped`: no prefill answered, or the running prefill refused the hand-off (e.g. a change of the node's ports
  that the prefill learns only when it restarts, later in the same `up`): nothing about the node is known, and it
  rejoins as it would without a canary.

Only httpx is imported: the supervisor runs without torch and vLLM.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from tilepd.auth import CANARY_TRANSFER_PREFIX, node_auth_header, transfer_token, vllm_auth_header
from tilepd.contracts.decode_http import NODE_API_VERSION, CancelBody, DecodeBody, RenewBody, ReserveBody
from tilepd.contracts.marker import MARKER_KEY, RESULT_KEY, TilepdMarker
from tilepd.contracts.teacher_forced import DEFAULT_MARGIN_NATS, ScoringError, Verdict, judge, scores_from_vllm, scoring_request
from tilepd.runbooks import see
from tilepd.router.logprobs import token_id  # the prefill runs with --return-tokens-as-token-ids (tilepd.plan.vllm_args)

DEFAULT_PROMPT = tuple(range(100, 116))  # 16 ordinary token ids of any real vocabulary (not BOS/EOS/padding)
PREFILL_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 5.0  # a prefill host that is down must not hold the rolling restart for a minute


class CanarySpec(BaseModel):
    """What the supervisor needs to send a decode node its canary (tilepd.deploy.inventory.service_spec renders it)."""

    model_config = ConfigDict(extra="forbid")

    node: str  # the decode node's name in the topology
    prefill_urls: list[str] = Field(min_length=1)
    model: str  # the name the prefill serves
    ctrl_host: str  # the node's control endpoint as the prefill's allowlist names it
    ctrl_port: int
    prompt_tokens: list[int] = Field(default_factory=lambda: list(DEFAULT_PROMPT), min_length=1)
    max_tokens: int = Field(default=16, ge=2)
    kv_timeout_s: float = Field(default=30.0, gt=0)
    margin_nats: float = Field(default=DEFAULT_MARGIN_NATS, ge=0)


@dataclass
class NodeCanaryResult:
    outcome: Literal["ok", "failed", "skipped"]
    reason: str
    transfer_id: str
    tokens: list[int] = field(default_factory=list)
    verdict: dict[str, Any] | None = None  # the teacher-forced verdict (tilepd.contracts.teacher_forced.Verdict.as_json)
    prefill_url: str | None = None
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _token_ids(body: dict[str, Any]) -> list[int]:
    return [token_id(t) for t in body["choices"][0]["logprobs"]["tokens"]]


def _post(url: str, body: dict[str, Any], request_id: str, secret: bytes | None) -> dict[str, Any]:
    r = httpx.post(f"{url.rstrip('/')}/v1/completions", json=body, timeout=httpx.Timeout(PREFILL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                   headers={"x-request-id": request_id, **vllm_auth_header(secret)})
    r.raise_for_status()
    return r.json()


def _prefill(url: str, spec: CanarySpec, marker: dict[str, Any], secret: bytes | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": spec.model, "prompt": spec.prompt_tokens, "max_tokens": 1, "temperature": 0,
                            "logprobs": 1, "ignore_eos": True, "stream": False, "kv_transfer_params": marker}
    return _post(url, body, str(marker[MARKER_KEY]["transfer_id"]), secret)


def verify_with_prefill(url: str, model: str, prompt: list[int], tokens: list[int], margin: float, secret: bytes | None,
                        request_id: str) -> Verdict:
    """Teacher-forced verification of `tokens` by the prefill at `url`; raises httpx.HTTPError or ScoringError."""
    body = _post(url, scoring_request(model, prompt, tokens), request_id, secret)
    return judge(scores_from_vllm(body, len(prompt), tokens), margin)


def _cancel(node_base_url: str, transfer_id: str, secret: bytes | None) -> None:
    """Best effort: the node frees its slot if the canary's KV holds it, or refuses that KV when it comes later."""
    try:
        httpx.post(f"{node_base_url.rstrip('/')}/v1/cancel", json=CancelBody(transfer_id=transfer_id).as_json(), headers=node_auth_header(secret),
                   timeout=CONNECT_TIMEOUT_S)
    except httpx.HTTPError:
        pass


def _reserve(node_base_url: str, tid: str, token: str, secret: bytes | None) -> tuple[int, float] | str:
    """The node's slot for the canary: (fence, lease_s), or why the node refused it."""
    body = ReserveBody(transfer_id=tid, token=token, holder=f"tilepd up canary ({socket.gethostname()})", node_api=NODE_API_VERSION)
    try:
        r = httpx.post(f"{node_base_url.rstrip('/')}/v1/reserve", json=body.as_json(), headers=node_auth_header(secret),
                       timeout=CONNECT_TIMEOUT_S)
        if r.status_code != 200:
            return f"the node refused the canary's reservation: {r.status_code} {r.text[:300]}"
        grant = r.json()
        return int(grant["fence"]), float(grant["lease_s"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return f"the node did not reserve its slot for the canary: {type(exc).__name__}: {exc}"


def _renew_until(stop: threading.Event, node_base_url: str, tid: str, fence: int, lease_s: float, secret: bytes | None) -> None:
    """Renew the canary's reservation every quarter of its lease until `stop` (the prefill may take longer than it)."""
    body = RenewBody(transfer_id=tid, fence=fence).as_json()
    while not stop.wait(lease_s / 4):
        try:
            httpx.post(f"{node_base_url.rstrip('/')}/v1/renew", json=body, headers=node_auth_header(secret), timeout=lease_s / 4)
        except httpx.HTTPError:
            pass


def run_canary(spec: CanarySpec, node_base_url: str, secret: bytes | None) -> NodeCanaryResult:
    """Send the canary; never raises for what the prefill or the node answers (the outcome says it)."""
    t0 = time.monotonic()
    tid = f"{CANARY_TRANSFER_PREFIX}{uuid.uuid4().hex}"
    token = transfer_token(secret, tid) if secret else uuid.uuid4().hex
    granted = _reserve(node_base_url, tid, token, secret)
    if isinstance(granted, str):
        return NodeCanaryResult("failed", granted, tid, seconds=round(time.monotonic() - t0, 3))
    fence, lease_s = granted
    stop = threading.Event()
    renewer = threading.Thread(target=_renew_until, args=(stop, node_base_url, tid, fence, lease_s, secret), daemon=True,
                               name="canary-renew")
    renewer.start()
    try:
        return _send(spec, node_base_url, secret, tid, token, fence, t0)
    finally:
        stop.set()


def _send(spec: CanarySpec, node_base_url: str, secret: bytes | None, tid: str, token: str, fence: int, t0: float) -> NodeCanaryResult:
    """The canary's prefill and decode on its reservation."""
    marker = TilepdMarker(host=spec.ctrl_host, ctrl_port=spec.ctrl_port, transfer_id=tid, token=token).as_params()

    def result(outcome: Literal["ok", "failed", "skipped"], reason: str, **kw: Any) -> NodeCanaryResult:
        if outcome != "ok":  # the reservation (and any KV the prefill sent) must not hold the node's slot until it expires
            _cancel(node_base_url, tid, secret)
        return NodeCanaryResult(outcome, reason, tid, seconds=round(time.monotonic() - t0, 3), **kw)

    tried: list[str] = []
    for url in spec.prefill_urls:
        try:
            body = _prefill(url, spec, marker, secret)
        except httpx.HTTPStatusError as exc:
            tried.append(f"{url} answered {exc.response.status_code}: {exc.response.text[:200]}")
            continue
        except httpx.HTTPError as exc:
            tried.append(f"{url}: {type(exc).__name__}: {exc}")
            continue
        break
    else:
        return result("skipped", "no prefill took the canary: " + "; ".join(tried))
    try:
        first = _token_ids(body)[0]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return result("skipped", f"the prefill {url} answered without a first token id: {exc}", prefill_url=url)
    handoff = (body.get("kv_transfer_params") or {}).get(RESULT_KEY) or {}
    if handoff.get("state") == "refused":
        return result("skipped", f"the running prefill {url} refused the hand-off to this node: {handoff.get('reason', '?')}",
                      prefill_url=url)
    decode = DecodeBody(transfer_id=tid, token=token, fence=fence, first_token=first, prompt_tokens=len(spec.prompt_tokens),
                        max_tokens=spec.max_tokens - 1, temperature=0, ignore_eos=True, stream=False,
                        kv_timeout_s=spec.kv_timeout_s).as_json()
    try:
        r = httpx.post(f"{node_base_url.rstrip('/')}/v1/decode", json=decode, headers={"x-request-id": tid, **node_auth_header(secret)},
                       timeout=spec.kv_timeout_s + PREFILL_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return result("failed", f"the node did not answer the canary's decode: {type(exc).__name__}: {exc}", prefill_url=url)
    if r.status_code != 200:
        return result("failed", f"the node answered the canary's decode with {r.status_code}: {r.text[:300]}", prefill_url=url)
    try:
        tokens = [first] + [int(t) for t in r.json()["tokens"]]
    except (KeyError, TypeError, ValueError) as exc:
        return result("failed", f"the node's answer to the canary holds no tokens: {exc}: {r.text[:200]}", prefill_url=url)
    if len(tokens) != spec.max_tokens:
        return result("failed", f"the node decoded {len(tokens) - 1} tokens, {spec.max_tokens - 1} were asked for", tokens=tokens,
                      prefill_url=url)
    try:
        verdict = verify_with_prefill(url, spec.model, spec.prompt_tokens, tokens, spec.margin_nats, secret, f"{tid}-verify")
    except (httpx.HTTPError, ScoringError) as exc:
        return result("failed", f"the prefill {url} could not score the node's tokens (teacher-forced verification): "
                      f"{type(exc).__name__}: {exc}", tokens=tokens, prefill_url=url)
    if not verdict.ok:
        return result("failed", f"the node's tokens diverge from the prefill's model: {verdict.describe()}" + see("RB-divergence"),
                      tokens=tokens, verdict=verdict.as_json(), prefill_url=url)
    return result("ok", f"{spec.max_tokens} tokens through prefill {url} and the node; {verdict.describe()}", tokens=tokens,
                  verdict=verdict.as_json(), prefill_url=url)
