"""Topology strings reach Ansible as data: a Jinja lookup in an env value runs nothing, an inline chat
template in `extra_args` arrives verbatim (real ansible-runner, local connection, router role only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.deploy import topo
from tests.deploy.cli import processes_mentioning, tilepd

pytestmark = pytest.mark.slow

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}{{ '<|assistant|>' }}"


def test_a_jinja_lookup_in_the_topology_runs_nothing_and_a_chat_template_passes_verbatim(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = topo.local_topology(tmp_path, name="t-unsafe")
    data["router"]["env"] = {"TILEPD_TEST_LOOKUP": "{{ lookup('pipe', 'touch " + str(marker) + "') }}"}
    data["prefill"][0]["extra_args"] += ["--chat-template", CHAT_TEMPLATE]
    file = topo.write(data, tmp_path / "topology.yaml")
    home, base = tmp_path / "home", Path(data["deployment"]["base_dir"])
    try:
        check = tilepd(home, "up", str(file), "--only", "router", "--check")
        assert check.rc == 0, check
        assert not marker.exists(), "a topology value was run as a Jinja template during up --check"
        up = tilepd(home, "up", str(file), "--only", "router")
        assert up.rc == 0, up
        assert not marker.exists()
        router = json.loads((base / "run" / "router.spec.json").read_text())
        assert router["env"]["TILEPD_TEST_LOOKUP"] == data["router"]["env"]["TILEPD_TEST_LOOKUP"]
        prefill = json.loads(next((base / "run").glob("prefill-*.spec.json")).read_text())
        assert prefill["argv"][prefill["argv"].index("--chat-template") + 1] == CHAT_TEMPLATE
    finally:
        tilepd(home, "down", str(file))
    assert processes_mentioning(str(base)) == []
