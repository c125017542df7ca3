"""Progress for people, from ansible-runner's event stream: current task, per-host outcomes, a summary."""

from __future__ import annotations

from rich.console import Console
from rich.status import Status
from rich.table import Table

from tilepd.deploy.runner import PlaybookResult, TaskEvent

_MARK = {"changed": "[yellow]changed[/]", "failed": "[red]failed[/]", "unreachable": "[red]unreachable[/]"}


class Progress:
    """Spinner with the running task; one line per changed/failed host result (ok results stay quiet)."""

    def __init__(self, console: Console, *, verbose: bool = False) -> None:
        self.console = console
        self.verbose = verbose
        self.play = ""
        self._status: Status | None = None

    def __enter__(self) -> "Progress":
        self._status = self.console.status("starting ansible ...")
        self._status.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.__exit__(None, None, None)

    def __call__(self, ev: TaskEvent) -> None:
        if ev.kind == "play":
            self.play = ev.play or ""
            self.console.print(f"[bold]{self.play}[/]")
        elif ev.kind == "task" and self._status is not None:
            self._status.update(f"{self.play}: {ev.task}")
        elif ev.kind in _MARK:
            line = f"  {ev.host:<18} {_MARK[ev.kind]:<26} {ev.task}"
            if ev.message and ev.kind != "changed":
                line += f"\n    {ev.message.strip().splitlines()[-1][:300]}"
            self.console.print(line, highlight=False)
        elif ev.kind == "ok" and self.verbose:
            self.console.print(f"  {ev.host:<18} [green]ok[/]        {ev.task}", highlight=False)


def summary_table(result: PlaybookResult, hosts: list[str], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("host", "ok", "changed", "failed", "unreachable"):
        table.add_column(col, justify="left" if col == "host" else "right")
    for host in hosts:
        failed = sum(1 for f in result.failures if f.host == host and not f.unreachable)
        unreachable = sum(1 for f in result.failures if f.host == host and f.unreachable)
        table.add_row(
            host,
            str(result.ok.get(host, 0)),
            f"[yellow]{result.changed.get(host, 0)}[/]" if result.changed.get(host) else "0",
            f"[red]{failed}[/]" if failed else "0",
            f"[red]{unreachable}[/]" if unreachable else "0",
        )
    return table
