"""Send one chat request through a deployment's router with the stock `openai` client.

Usage: python scripts/demo_chat.py TOPOLOGY.yaml
The key, when the topology names one, is read from the same env var or file the router uses.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
    raw = client.chat.completions.with_raw_response.create(
        model=topology.model.served_name,
        messages=[{"role": "user", "content": "Tell me a short story about a fast robot."}],
        max_tokens=32,
        temperature=0,
    )
    reply = raw.parse()
    print(f"router:        {base_url}")
    print(f"served by:     {raw.headers.get('x-tilepd-route', '?')} ({raw.headers.get('x-tilepd-route-reason', '')})")
    print(f"finish_reason: {reply.choices[0].finish_reason}; usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens")
    print(f"reply:         {reply.choices[0].message.content!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1] / "topology_examples" / "local.yaml")))
