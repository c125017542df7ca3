"""Send one chat request through a deployment's router with the stock `openai` client.

Usage: python scripts/demo_chat.py TOPOLOGY.yaml
The key, when the topology names one, is read from the same env var or file the router uses.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import openai

from tilepd.topology import load_topology
from tilepd.topology.schema import Topology


def _api_key(topology: Topology) -> str:
    source = topology.router.api_key
    if source is None:
        return "none"
    if source.env:
        return os.environ[source.env]
    return Path(source.file).read_text().strip()


def main(path: str) -> int:
    topology = load_topology(path)
    router = topology.router
    base_url = f"http://{router.address}:{router.port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key=_api_key(topology), timeout=120)
    key = _api_key(topology)
    raw = client.chat.completions.with_raw_response.create(
        model=topology.model.served_name,
        messages=[{"role": "user", "content": "Tell me a short story about a fast robot."}],
        max_tokens=32,
        temperature=0,
        extra_headers={"x-tilepd-verify": "1"},  # the router's divergence watch checks this request (greedy)
    )
    reply = raw.parse()
    print(f"router:        {base_url}")
    print(f"served by:     {raw.headers.get('x-tilepd-route', '?')} ({raw.headers.get('x-tilepd-route-reason', '')})")
    print(f"finish_reason: {reply.choices[0].finish_reason}; usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens")
    print(f"reply:         {reply.choices[0].message.content!r}")
    if topology.model.generate_tiny:
        print("               (the tiny random test model's text is noise by design: its weights are random; what shows the\n"
              "                stack works is the verification below: the prefill's model agrees with every token the node chose)")
    if raw.headers.get("x-tilepd-route") == "low_latency":
        print(f"verification:  {_verdict(f'http://{router.address}:{router.port}', key, raw.headers.get('x-request-id', ''))}")
    return 0


def _verdict(router_url: str, key: str, request_id: str, wait_s: float = 60.0) -> str:
    """The router's teacher-forced verdict on the request (its /status, `divergence.recent`): the prefill scored the
    reply's tokens, each must be its top-1 or within the margin."""
    headers = {"Authorization": f"Bearer {key}"} if key != "none" else {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            recent = httpx.get(f"{router_url}/status", headers=headers, timeout=10).json().get("divergence", {}).get("recent", [])
        except (httpx.HTTPError, ValueError) as exc:
            return f"the router's /status did not answer ({type(exc).__name__})"
        for check in recent:
            if check.get("request_id") == request_id:
                return f"node {check.get('node')}: {check['verdict'].get('summary')}"
        time.sleep(0.5)
    return f"no verdict for {request_id} within {wait_s:g} s (router.divergence_watch disabled?)"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1] / "topology_examples" / "local.yaml")))
