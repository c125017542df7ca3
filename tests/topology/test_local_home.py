"""The local default lives under the user's own home (`~` in local.yaml), not one /tmp folder shared by users."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilepd.plan import build_plan
from tilepd.resources import examples_dir
from tilepd.topology import TopologyError, load_topology, load_topology_text
from tilepd.topology.home import expand_home

LOCAL = examples_dir() / "local.yaml"


def test_each_user_gets_their_own_local_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plans = {}
    for user in ("alice", "bob"):
        monkeypatch.setenv("HOME", str(tmp_path / user))
        plans[user] = build_plan(load_topology(LOCAL))
    for user, plan in plans.items():
        state = f"{tmp_path / user}/.local/state/tilepd/local"
        (host,) = plan.hosts
        assert host.base_dir == state
        assert all(s.log_file.startswith(state + "/") and s.pid_file.startswith(state + "/") for s in host.services)
        assert plan.service("tiny-model").creates == f"{state}/models/tiny-llama/config.json"
    assert plans["alice"].topology_hash != plans["bob"].topology_hash


def test_tilde_on_a_remote_host_is_refused_naming_the_field() -> None:
    text = LOCAL.read_text().replace("127.0.0.1", "10.0.0.5").replace("python: current", "python: /usr/bin/python3")
    with pytest.raises(TopologyError) as exc:
        load_topology_text(text, "remote.yaml")
    found = {f.path: f for f in exc.value.findings}
    assert {"deployment.base_dir", "model.hf_path", "model.weights_path"} <= set(found), found
    assert all(f.rule == "absolute-path" and "loopback" in f.message for f in found.values())


def test_expand_home_fields() -> None:
    data = {
        "deployment": {"base_dir": "~/dep", "python": "~/venv/bin/python"},
        "model": {"hf_path": "~", "weights_path": "/abs/w"},
        "decode": [{"address": "127.0.0.1", "base_dir": "~/d", "ssh": {"key_file": "~/.ssh/id"}}],
        "router": {"address": "localhost", "api_key": {"file": "~/key"}},
        "prefill": [{"address": "::1", "python": "~user/py"}],  # `~user` is not expanded
    }
    expand_home(data, Path("/home/u"))
    assert data["deployment"] == {"base_dir": "/home/u/dep", "python": "/home/u/venv/bin/python"}
    assert data["model"] == {"hf_path": "/home/u", "weights_path": "/abs/w"}
    assert data["decode"][0] == {"address": "127.0.0.1", "base_dir": "/home/u/d", "ssh": {"key_file": "/home/u/.ssh/id"}}
    assert data["router"]["api_key"]["file"] == "/home/u/key" and data["prefill"][0]["python"] == "~user/py"
    remote = {"deployment": {"base_dir": "~/dep"}, "router": {"address": "10.1.1.1", "ssh": {"key_file": "~/.ssh/k"}}}
    expand_home(remote, Path("/home/u"))
    assert remote == {"deployment": {"base_dir": "~/dep"}, "router": {"address": "10.1.1.1", "ssh": {"key_file": "/home/u/.ssh/k"}}}


def test_malformed_documents_are_left_to_the_schema() -> None:
    for data in ({"prefill": 5, "router": "x"}, {"decode": [1, "a", None]}, {"deployment": [], "model": 3}, {"router": {"address": 7}}):
        before = repr(data)
        expand_home(data, Path("/home/u"))
        assert repr(data) == before
