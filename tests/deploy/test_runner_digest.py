"""How `tilepd up` reads ansible-runner's events: an ignored unreachable is no failure, a real one is."""

from __future__ import annotations

from tilepd.deploy.runner import PlaybookResult, _Digest


def _unreachable(host: str) -> dict:
    return {"event": "runner_on_unreachable", "event_data": {
        "host": host, "task": "Deployment secret already on the hosts", "res": {"msg": "ssh: connect to host 10.0.0.12 port 22: No route to host"}}}


def test_an_ignored_unreachable_item_is_not_a_failure() -> None:
    # the secrets play slurps every host's secret, down ones too, with ignore_unreachable: Ansible counts that host
    # "ignored", not "dark", and the run goes on (tests/deploy/test_systemd_pid1.py boots no prefill host)
    result = PlaybookResult("up.yml", "successful", 0)
    digest = _Digest(result, None)
    digest(_unreachable("10.0.0.11"))
    assert result.unreachable  # seen while the run goes
    digest({"event": "playbook_on_stats", "event_data": {"dark": {}, "ignored": {"10.0.0.11": 1}, "ok": {"10.0.0.11": 16}}})
    assert result.failures == []


def test_a_host_ansible_counts_unreachable_stays_a_failure() -> None:
    result = PlaybookResult("up.yml", "failed", 4)
    digest = _Digest(result, None)
    digest(_unreachable("10.0.0.11"))
    digest({"event": "playbook_on_stats", "event_data": {"dark": {"10.0.0.11": 1}, "ok": {}}})
    (failure,) = result.unreachable
    assert failure.host == "10.0.0.11" and "No route to host" in failure.message
