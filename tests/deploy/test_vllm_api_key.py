"""Every vLLM the deployment starts requires the key derived from the deployment secret: the plan's argv and env
carry only the middleware and the secret file's path, and a real vLLM CPU answers a keyless request with 401."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from tilepd.auth import new_secret, vllm_api_key, vllm_auth_header
from tilepd.connector.launch import start_vllm
from tilepd.deploy.inventory import service_spec
from tilepd.doctor.checks_live import probe_vllm_auth
from tilepd.plan import build_plan
from tilepd.plan.vllm_args import API_KEY_MIDDLEWARE, SECRET_FILE_ENV
from tilepd.resources import examples_dir
from tilepd.router.upstream import Upstream
from tilepd.topology import load_topology


@pytest.mark.parametrize("example", ["local.yaml", "dsv32-multiconnector.yaml"])
def test_the_plan_starts_every_vllm_with_the_key_middleware_and_only_the_secret_path(example: str) -> None:
    plan = build_plan(load_topology(examples_dir() / example))
    vllms = [(h, s) for h in plan.hosts for s in h.services if s.role in ("prefill", "native_decode")]
    assert vllms and {s.role for _, s in vllms} >= {"prefill"}
    for host, svc in vllms:
        assert svc.argv[svc.argv.index("--middleware") + 1] == API_KEY_MIDDLEWARE, svc.name
        path = svc.env[SECRET_FILE_ENV]
        assert path in {s.path for s in host.secrets if s.name == "deployment"}  # `up` places it (0600) on that host
        assert Path(path) in service_spec(plan, svc).secret_files  # a rotated secret restarts the vLLM
        assert not any("api-key" in a or "API_KEY" in a for a in [*svc.argv, *svc.env])


@pytest.mark.slow
def test_a_keyless_request_to_a_prefill_port_gets_401(tiny_llama: Path, tmp_path: Path) -> None:
    secret_file = tmp_path / "secrets" / "deployment"
    secret_file.parent.mkdir()
    secret_file.write_text(new_secret())
    secret_file.chmod(0o600)
    key = vllm_api_key(secret_file.read_text().strip().encode())
    args = ["--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "256", "--served-model-name", "tiny",
            "--enforce-eager", "--middleware", API_KEY_MIDDLEWARE]
    srv = start_vllm(tiny_llama, tmp_path / "vllm.log", kv_config=None, extra_args=args, env={SECRET_FILE_ENV: str(secret_file)})
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0,
                "kv_transfer_params": {"tilepd": {"host": "10.9.9.9", "ctrl_port": 1, "transfer_id": "x", "token": "y"}}}
        keyless = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert keyless.status_code == 401, keyless.text
        wrong = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "Bearer " + "0" * 64}, timeout=60)
        assert wrong.status_code == 401
        assert httpx.post(f"{srv.url}/tokenize", json={"model": "tiny", "prompt": "hi"}, timeout=60).status_code == 401  # vLLM's own key leaves it open
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200  # the supervisor's and status's probe
        assert httpx.get(f"{srv.url}/metrics", timeout=10).status_code == 200  # doctor's and status's figures
        keyed = httpx.post(f"{srv.url}/v1/completions", json={**body, "kv_transfer_params": None}, headers=vllm_auth_header(secret_file.read_text().strip().encode()), timeout=120)
        assert keyed.status_code == 200, keyed.text

        async def through_the_router_client() -> int:  # the router's upstream adds the key for a vLLM base URL
            up = Upstream(connect_timeout_s=5, read_timeout_s=120, auth_by_base_url={srv.url: {"Authorization": f"Bearer {key}"}})
            try:
                return (await up.request("POST", f"{srv.url}/v1/completions", body={**body, "kv_transfer_params": None})).status
            finally:
                await up.aclose()

        assert asyncio.run(through_the_router_client()) == 200
        finding = probe_vllm_auth("127.0.0.1", "prefill-p0", srv.url)  # what `tilepd doctor` reports for a running vLLM
        assert finding.verdict == "ok" and "answers 401" in finding.evidence, finding
        for pid in [srv.proc.pid, *_children(srv.proc.pid)]:  # the key is in no argv and no environment
            for what in ("cmdline", "environ"):
                try:
                    assert key.encode() not in Path(f"/proc/{pid}/{what}").read_bytes(), (pid, what)
                except FileNotFoundError:
                    pass
    finally:
        srv.stop()


def _children(pid: int) -> list[int]:
    """vLLM's EngineCore and other direct children of `pid`."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # ppid
                out.append(int(entry.name))
    return out
