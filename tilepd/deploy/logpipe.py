"""Bounded, rotated service logs in process mode (systemd mode sends output to journald instead).

The supervisor (tilepd.deploy.proc) starts a service as
`python -I -S .../logpipe.py --file F -- ARGV...`: this script forks a pump that owns the log
file, points its own stdout/stderr at a pipe into the pump and execs ARGV in place, so the
supervisor's pid, kernel start time and process group are the service's own. The pump appends
what it reads; when F would pass the size cap it ends F at a line boundary, renames
F -> F.1 -> ... -> F.<backups> (the oldest is dropped) and starts a new F: at most
(backups + 1) x cap bytes per service. It ignores SIGTERM/SIGINT/SIGHUP, because
a stop signals the whole group and the lines a service writes while it shuts down must still be
kept; it ends at EOF, when the last writer (the service, or a child that outlived it) is gone.

The cap and the number of old files come from the service's environment (a topology entry's
`env:`): TILEPD_LOG_MAX_BYTES (default 64 MiB, at least 4 KiB) and TILEPD_LOG_BACKUPS (default 4).

Run as a script by path, standard library only: it imports no tilepd, so it starts in
milliseconds and cannot pick up another installed copy of tilepd than the supervisor's.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_BACKUPS = 4
MIN_MAX_BYTES = 4096
READ_BYTES = 65536


class RotatingFile:
    """Append-only log file of bounded size, rotated at line boundaries into `path.1` ... `path.<backups>`."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS) -> None:
        if max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"log size cap {max_bytes} B is below {MIN_MAX_BYTES} B")
        if backups < 0:
            raise ValueError(f"log backups {backups} must be >= 0")
        self.path, self.max_bytes, self.backups = Path(path), max_bytes, backups
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = -1
        self._open()
        if self.size >= self.max_bytes:
            self.rotate()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = os.fstat(self._fd).st_size

    def rotate(self) -> None:
        os.close(self._fd)
        if self.backups == 0:
            os.truncate(self.path, 0)
        else:
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._open()

    def _put(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.size += len(data)

    def write(self, data: bytes) -> None:
        """Append `data`; what does not fit ends the current file at its last whole line, the rest starts the next."""
        while self.size + len(data) > self.max_bytes:
            room = self.max_bytes - self.size
            cut = data.rfind(b"\n", 0, room) + 1
            if cut == 0 and self.size == 0:
                cut = room  # a line longer than a whole file: cut it at the cap
            if cut:
                self._put(data[:cut])
                data = data[cut:]
            self.rotate()
        if data:
            self._put(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def pump(fd: int, out: RotatingFile) -> None:
    """Copy everything from `fd` into `out` until EOF (every writer closed)."""
    while True:
        try:
            chunk = os.read(fd, READ_BYTES)
        except InterruptedError:
            continue
        if not chunk:
            return
        out.write(chunk)


def wrap(argv: list[str], log_file: Path, python: str | None = None) -> list[str]:
    """The command line that runs `argv` with its output going through a pump into `log_file`."""
    return [python or sys.executable, "-I", "-S", str(Path(__file__).resolve()), "--file", str(log_file), "--", *argv]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def main(args: list[str]) -> int:
    if len(args) < 4 or args[0] != "--file" or args[2] != "--":
        print("usage: logpipe.py --file LOG -- ARGV...", file=sys.stderr)
        return 2
    log_file, argv = Path(args[1]), args[3:]
    try:
        out = RotatingFile(log_file, _env_int("TILEPD_LOG_MAX_BYTES", DEFAULT_MAX_BYTES), _env_int("TILEPD_LOG_BACKUPS", DEFAULT_BACKUPS))
    except (ValueError, OSError) as exc:  # goes to the supervisor's own log file (our stderr): the service is not started
        print(f"tilepd logpipe: {log_file}: {exc}", file=sys.stderr, flush=True)
        return 2
    r, w = os.pipe()
    if os.fork() == 0:  # the pump: stays in the service's process group, so `stop` and `status` see it
        os.close(w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        code = 0
        try:
            pump(r, out)
        except OSError as exc:
            print(f"tilepd logpipe: {log_file}: {exc}", file=sys.stderr, flush=True)
            code = 1
        finally:
            out.close()
        os._exit(code)
    out.close()
    os.close(r)
    os.dup2(w, 1)
    os.dup2(w, 2)
    os.close(w)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"tilepd logpipe: cannot run {argv[0]}: {exc}\n".encode())
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
