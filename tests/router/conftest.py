"""Session-wide real processes for the router tests: started once, shared by every module here.

vLLM starts are the expensive part (tens of seconds each on 2 cores), so there are two:
one prefill (MultiConnector: tilepd connector + NixlConnector producer) that serves both
pools, and one native decode (NixlConnector consumer). The prefill without a marker or
NIXL params is also "vLLM alone", the reference for greedy output.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.reserved import reserve_http
from tilepd.connector.launch import Server
from tilepd.contracts.service_configs import DecodeEndpoint, RouterConfig

from .otlp_receiver import Receiver
from .stack import (
    MODEL_NAME,
    router_config,
    spare_endpoint,
    start_decode_node,
    start_native_decode,
    start_prefill,
    start_router,
    stop_all,
)

SPARE_NODES = ("f1", "f2")  # allowlisted, started by the fault tests (test_node_faults.py) only
LOG_LINES_ON_FAILURE = 30
STACK_DUMP_LINES_ON_FAILURE = 120  # a node's faulthandler dump after a stall (tilepd.runtime.stall_watch)
_LOG_OFFSETS = pytest.StashKey[tuple[Path, dict[Path, int]]]()


def _engine_available() -> bool:
    import tilepd.engine

    return hasattr(tilepd.engine, "load_engine")


class Stack:
    def __init__(self, model: Path, workdir: Path) -> None:
        self.model = model
        self.workdir = workdir
        self.servers: list[Server] = []
        self.decode: Server | None = None
        self.endpoint: DecodeEndpoint | None = None
        self.prefill: Server | None = None
        self.native: Server | None = None
        self.native_prefill_url: str | None = None  # default: the prefill (MultiConnector serves both pools)
        self.spares: list[DecodeEndpoint] = [spare_endpoint(n) for n in SPARE_NODES]
        # the collector the prefill's connector exports to (only requests a tracing router marks are traced)
        self.otlp = Receiver()

    @property
    def decode_url(self) -> str:
        assert self.endpoint is not None
        return f"http://127.0.0.1:{self.endpoint.http_port}"

    def config(self, *, native: bool, **overrides: object) -> RouterConfig:
        assert self.prefill is not None and self.endpoint is not None
        native_urls = (self.native_prefill_url or self.prefill.url, self.native.url) if (native and self.native is not None) else None
        # these routers serve API tests, not failure detection (test_node_faults.py sets its own): on the loaded 2-core
        # CI box the shared node's /health once missed two 2 s checks while it waited for a KV, and the router
        # took it out of rotation mid-request
        lenient: dict[str, object] = {"health_timeout_s": 5.0, "breaker_failures": 3}
        return router_config(self.model, self.prefill.url, [self.endpoint], native=native_urls,  # type: ignore[arg-type]
                             **{**lenient, **overrides})


# package scope: the stack (vLLM prefill with NIXL, the native pair, a decode node) ends with the last test of
# tests/router, not with the session. Alive, its NIXL/UCX progress threads keep about one core busy (a prefill worker
# used 2375 CPU-seconds in 49 min), which slowed every later test on the 2-core box (a deploy test ran 10+ min).
@pytest.fixture(scope="package")
def router_stack(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not _engine_available():
        pytest.skip("tilepd.engine.load_engine is not in this build yet: no decode node can start")
    stack = Stack(tiny_llama, tmp_path_factory.mktemp("router-stack"))
    reuse = os.environ.get("TILEPD_ROUTER_TEST_REUSE")
    if reuse:  # development only: servers someone already started (JSON: model, prefill, native, decode endpoint+pid, spares)
        yield _reused(stack, json.loads(Path(reuse).read_text()))
        return
    try:
        stack.decode, stack.endpoint = start_decode_node(tiny_llama, stack.workdir)
        stack.servers.append(stack.decode)
        stack.prefill = start_prefill(tiny_llama, stack.workdir, [stack.endpoint, *stack.spares], with_nixl=True,
                                      otlp_endpoint=stack.otlp.url)
        stack.servers.append(stack.prefill)
        stack.native = start_native_decode(tiny_llama, stack.workdir)
        stack.servers.append(stack.native)
        _warm_up(stack)
        yield stack
    finally:
        stop_all(stack.servers)
        stack.otlp.close()


def _warm_up(stack: Stack) -> None:
    """vLLM's first requests are slow (lazy init); on a loaded machine slow enough that a decode node
    reaps the admitted KV as orphaned before the router's decode call comes. One request down each
    path before the tests keeps their timing about the router, not about vLLM's warm-up."""
    assert stack.prefill is not None and stack.native is not None and stack.endpoint is not None
    plain = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 2, "logprobs": 1, "temperature": 0}
    for url in (stack.prefill.url, stack.native.url):
        httpx.post(url + "/v1/completions", json=plain, timeout=600).raise_for_status()
    ep = stack.endpoint
    fence = reserve_http(stack.decode_url, "tx-warmup", "warmup")
    marker = {"tilepd": {"host": ep.host, "ctrl_port": ep.ctrl_port, "transfer_id": "tx-warmup", "token": "warmup"}}
    r = httpx.post(stack.prefill.url + "/v1/completions", json={**plain, "max_tokens": 1, "kv_transfer_params": marker}, timeout=600)
    r.raise_for_status()
    first = int(r.json()["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
    body = {"transfer_id": "tx-warmup", "token": "warmup", "fence": fence, "first_token": first, "prompt_tokens": 4, "max_tokens": 2,
            "stream": False, "kv_timeout_s": 120}
    httpx.post(stack.decode_url + "/v1/decode", json=body, timeout=300).raise_for_status()


def _reused(stack: Stack, info: dict) -> Stack:
    class _Proc:
        pid = info["decode_pid"]

    stack.model = Path(info["model"])
    stack.prefill = Server(subprocess.Popen(["true"]), info["prefill"], Path("/dev/null"))
    stack.native = Server(subprocess.Popen(["true"]), info["native"], Path("/dev/null"))
    stack.decode = Server(_Proc(), f"http://127.0.0.1:{info['decode']['http_port']}", Path("/dev/null"))  # type: ignore[arg-type]
    stack.endpoint = DecodeEndpoint(**info["decode"])
    stack.spares = [DecodeEndpoint(**e) for e in info.get("spares", [])]  # must be in the reused prefill's allowlist
    stack.native_prefill_url = info.get("native_prefill")
    return stack


@pytest.fixture(scope="package")
def start_router_proc(router_stack: Stack) -> Iterator[Callable[..., tuple[Server, RouterConfig]]]:
    """Start a router process for a config; every router started is stopped with the stack."""
    started: list[Server] = []

    def start(config: RouterConfig, env: dict[str, str] | None = None) -> tuple[Server, RouterConfig]:
        srv = start_router(config, router_stack.workdir, name=f"router-{len(started)}", env=env)
        started.append(srv)
        return srv, config

    yield start
    stop_all(started)


@pytest.fixture(scope="package")
def plain_router(router_stack: Stack, start_router_proc: Callable[..., tuple[Server, RouterConfig]]) -> tuple[str, RouterConfig]:
    """A router with the low-latency pool only (queue timeout 2 s), shared by every module."""
    srv, cfg = start_router_proc(router_stack.config(native=False, queue_timeout_s=2.0))
    return srv.url, cfg


@pytest.fixture(scope="package")
def native_router(router_stack: Stack, start_router_proc: Callable[..., tuple[Server, RouterConfig]]) -> tuple[str, RouterConfig]:
    """A router with the native pool as fallback and `<model>-native` routed there."""
    srv, cfg = start_router_proc(router_stack.config(native=True, queue_timeout_s=2.0))
    return srv.url, cfg


@pytest.fixture(autouse=True)
def _remember_stack_logs(request: pytest.FixtureRequest) -> None:
    """Where each stack log ended when a test on the shared stack started (see pytest_runtest_makereport)."""
    if "router_stack" in request.fixturenames:
        stack: Stack = request.getfixturevalue("router_stack")
        request.node.stash[_LOG_OFFSETS] = (stack.workdir, {p: p.stat().st_size for p in stack.workdir.glob("*.log")})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test on the shared stack reports the warnings its servers logged meanwhile (a node taken out
    of rotation, a silent node, a failed transfer): CI keeps the failure text, not the logs."""
    outcome = yield
    rep = outcome.get_result()
    seen = item.stash.get(_LOG_OFFSETS, None)
    if not rep.failed or seen is None:
        return
    workdir, offsets = seen
    lines: list[str] = []
    dumps: list[str] = []
    for path in sorted(workdir.glob("*.log")):  # a router started during the test logs here too
        try:
            with path.open("rb") as f:
                f.seek(offsets.get(path, 0))
                new = f.read(4 << 20).decode(errors="replace").splitlines()
        except OSError:
            continue
        lines += [f"{path.name}: {line}" for line in new if "WARNING" in line or "ERROR" in line or "Traceback" in line]
        dumps += [f"{path.name}: {line}" for line in _stack_dumps(new)]
    if lines:
        rep.sections.append(("stack warnings during the test", "\n".join(lines[-LOG_LINES_ON_FAILURE:])))
    if dumps:
        rep.sections.append(("thread stacks a stalled server dumped", "\n".join(dumps[:STACK_DUMP_LINES_ON_FAILURE])))


def _stack_dumps(lines: list[str]) -> list[str]:
    """faulthandler's dumps among a log's lines: from its 'Timeout (h:mm:ss)!' header to the next ordinary line."""
    out: list[str] = []
    inside = False
    for line in lines:
        if line.startswith("Timeout ("):
            inside = True
        elif inside and not (line.startswith(("Thread 0x", "Current thread 0x", "  File ", "  <")) or not line.strip()):
            inside = False
        if inside:
            out.append(line)
    return out
