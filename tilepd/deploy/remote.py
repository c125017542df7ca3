"""Run a command on a deployment host: locally without SSH, otherwise over paramiko.

`tilepd status` and `tilepd logs` only read (a service's state, a log file), so they
talk to hosts directly rather than through a playbook run: it is faster and works
while ansible is busy. Commands are argv lists; over SSH they are joined with shlex.
"""

from __future__ import annotations

import getpass
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tilepd.deploy import host_keys
from tilepd.plan import HostPlan
from tilepd.runbooks import see


class HostUnreachable(Exception):
    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"{host}: unreachable over SSH: {reason}" + see("RB-host-unreachable"))
        self.host = host
        self.reason = reason


class HostKeyChanged(HostUnreachable):
    """The host offered another key than the one recorded at first contact: refused before authenticating."""

    def __init__(self, host: str, reason: str, offered: str, recorded: str) -> None:
        super().__init__(host, reason)
        self.offered, self.recorded = offered, recorded


@dataclass
class Output:
    rc: int
    stdout: str
    stderr: str


class HostShell:
    """Command runner for one plan host."""

    def __init__(self, host: HostPlan, *, known_hosts: Path | None = None, connect_timeout_s: float = 5.0) -> None:
        self.host = host
        self.known_hosts = known_hosts
        self.connect_timeout_s = connect_timeout_s
        self._client = None
        self._procs: list[subprocess.Popen[str]] = []
        # after a connect: "recorded" (first contact, the key was added to known_hosts) or "known" (it matched)
        self.host_key_status: str | None = None
        self.host_key_fingerprint: str | None = None

    def _ssh(self):  # noqa: ANN202 - paramiko.SSHClient, imported lazily
        if self._client is None:
            import paramiko

            client = paramiko.SSHClient()
            shell = self

            class _AcceptNew(paramiko.MissingHostKeyPolicy):
                """accept-new: an unknown host's key is recorded; a known host's other key raises BadHostKeyException."""

                def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
                    if shell.known_hosts is None:
                        raise paramiko.SSHException(f"no known_hosts file to record {hostname}'s key in")
                    host_keys.record(shell.known_hosts, hostname, key)
                    shell.host_key_status = "recorded"

            # the deployment's own known_hosts (trust on first use, shared with ansible)
            if self.known_hosts is not None:
                host_keys.ensure_file(self.known_hosts)
                client.load_host_keys(str(self.known_hosts))
            client.set_missing_host_key_policy(_AcceptNew())
            ssh = self.host.ssh
            try:
                client.connect(
                    self.host.address,
                    port=ssh.port,
                    username=ssh.user or getpass.getuser(),
                    key_filename=ssh.key_file,
                    timeout=self.connect_timeout_s,
                    banner_timeout=self.connect_timeout_s,
                    auth_timeout=self.connect_timeout_s,
                    allow_agent=ssh.key_file is None,
                    look_for_keys=ssh.key_file is None,
                )
            except paramiko.BadHostKeyException as e:
                assert self.known_hosts is not None  # a key is only "bad" against a recorded one
                raise HostKeyChanged(self.host.name, host_keys.changed_key_message(self.host.name, self.known_hosts, self.host.address, ssh.port),
                                     offered=host_keys.fingerprint(e.key), recorded=host_keys.fingerprint(e.expected_key)) from None
            except (OSError, paramiko.SSHException) as e:
                raise HostUnreachable(self.host.name, str(e) or type(e).__name__) from None
            transport = client.get_transport()
            if transport is not None:
                self.host_key_fingerprint = host_keys.fingerprint(transport.get_remote_server_key())
            self.host_key_status = self.host_key_status or "known"
            self._client = client
        return self._client

    def run(self, argv: list[str], timeout_s: float = 30.0) -> Output:
        if self.host.local:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
            return Output(p.returncode, p.stdout, p.stderr)
        chan = self._exec(shlex.join(argv), timeout_s)
        try:
            stdout = chan.makefile("rb").read().decode(errors="replace")
            stderr = chan.makefile_stderr("rb").read().decode(errors="replace")
            return Output(chan.recv_exit_status(), stdout, stderr)
        finally:
            chan.close()

    def _exec(self, command: str, timeout_s: float | None, pty: bool = False):  # noqa: ANN202 - paramiko.Channel, imported lazily
        """A session channel running `command`, its stdin at EOF at once (pty: left open). Not SSHClient.exec_command: that hands back a
        stdin file whose close (also from its __del__, paramiko 5.1 ChannelStdinFile) takes the channel's lock, so a
        garbage collection that runs it on the transport thread while that thread holds the lock (closing the channel)
        deadlocks the transport and every caller waiting on it; `tilepd doctor` over SSH hung in Transport.close so."""
        transport = self._ssh().get_transport()
        if transport is None or not transport.is_active():
            raise HostUnreachable(self.host.name, "the SSH connection is closed")
        chan = transport.open_session(timeout=timeout_s)
        if pty:
            chan.get_pty()
        chan.settimeout(timeout_s)
        chan.exec_command(command)
        if not pty:  # a tty session keeps its input open, as exec_command left it (the stream's `tail -F` reads none)
            chan.shutdown_write()
        return chan

    def stream(self, argv: list[str]) -> Iterator[str]:
        """Lines of a long-running command (e.g. `tail -F`), until it ends or the caller stops."""
        if self.host.local:
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self._procs.append(p)
            try:
                assert p.stdout is not None
                for line in p.stdout:
                    yield line.rstrip("\n")
            finally:
                p.kill()
                p.wait()
            return
        chan = self._exec(shlex.join(argv), None, pty=True)
        try:
            for line in chan.makefile("r"):
                yield line.rstrip("\r\n")
        finally:
            chan.close()

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._procs.clear()
        if self._client is not None:
            self._client.close()
            self._client = None
