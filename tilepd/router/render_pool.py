"""Chat-template rendering, tokenising and tool-schema compiling in worker processes, each job bounded in time and memory.

A chat template is a Jinja program, and its cost follows the request (the messages, the kwargs the operator lets
clients pass): on the router's event loop one slow render stops every request, and one huge string can take the
router's memory. A thread cannot be interrupted, so the work goes to a few processes: each worker is forked from
the router with the tokenizer already loaded (a spawned one imports transformers again: over a minute on a loaded
2-core host), closes every descriptor but its pipe (a client's socket must not outlive the router's close), runs under
RLIMIT_AS (the router's address space plus `memory_mb`), and is killed and replaced when a job overruns
`timeout_s`. The client whose request overran gets a 400 naming the limit; the others are served by the remaining
workers meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import resource
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tilepd.router.errors import RouterError, invalid
from tilepd.router.tools import CompileJob, compile_problem

log = logging.getLogger("tilepd.router")

WORKER_START_TIMEOUT_S = 30.0  # a fork, then one small encode; a loaded host can hold it up for seconds


@dataclass(frozen=True)
class RenderLimits:
    workers: int
    timeout_s: float
    memory_mb: int


@dataclass(frozen=True)
class ChatJob:
    """apply_chat_template's arguments (tokenize=False), then the text tokenised without special tokens, as vLLM does."""

    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class TextJob:
    text: str
    add_special_tokens: bool


Job = ChatJob | TextJob | CompileJob


class _Worker:
    def __init__(self, proc: Any, conn: Connection) -> None:
        self.proc = proc
        self.conn = conn

    def kill(self) -> None:
        """SIGKILL and reap (no join timeout: the worker closed its sentinel pipe, so a timed join returns at once)."""
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class RenderPool:
    """`workers` processes; `render(job)` runs a job on a free one, off the event loop, within the limits."""

    def __init__(self, tokenizer: Any, limits: RenderLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._ctx = multiprocessing.get_context("fork")
        self._idle: asyncio.Queue[_Worker] | None = None
        self._replacing: set[asyncio.Task[None]] = set()
        self._started: list[_Worker] = [self._spawn() for _ in range(limits.workers)]
        for w in self._started:
            self._wait_ready(w)

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, self.tokenizer, self.limits.memory_mb << 20),
                                 name="tilepd-render", daemon=True)
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _wait_ready(self, w: _Worker) -> None:
        if not w.conn.poll(WORKER_START_TIMEOUT_S):
            w.kill()
            raise RuntimeError(f"a prompt-render worker did not start within {WORKER_START_TIMEOUT_S:.0f} s")
        try:
            msg = w.conn.recv()
        except EOFError:
            msg = ("failed", f"it exited with {w.proc.exitcode}")
        if msg[0] != "ready":
            w.kill()
            raise RuntimeError(f"a prompt-render worker failed to start: {msg[1]}")

    def _queue(self) -> asyncio.Queue[_Worker]:
        if self._idle is None:  # made on the serving loop, on first use
            self._idle = asyncio.Queue()
            for w in self._started:
                self._idle.put_nowait(w)
            self._started = []
        return self._idle

    async def render(self, job: Job, request_id: str) -> Any:
        """The job's answer (token ids; a compile job's problem or None); RouterError 400 when the job overran a limit
        or the template raised, 503 when no worker freed up."""
        idle = self._queue()
        lim = self.limits
        try:
            worker = await asyncio.wait_for(idle.get(), lim.timeout_s)
        except TimeoutError:
            raise RouterError(503, f"every prompt renderer stayed busy for {lim.timeout_s:g} s (prompt_render.workers="
                              f"{lim.workers}); retry later", type="service_unavailable", code="render_busy",
                              headers={"retry-after": "1"}) from None
        reply: Any = None
        try:
            worker.conn.send(job)
            reply = await asyncio.wait_for(_reply(worker.conn), lim.timeout_s)
        except TimeoutError:
            log.warning("req=%s event=render_limit limit=timeout_s value=%g pid=%d", request_id, lim.timeout_s, worker.proc.pid)
            raise _limit(job, f"took over {lim.timeout_s:g} s (prompt_render.timeout_s)") from None
        except (EOFError, OSError) as exc:
            log.warning("req=%s event=render_worker_died pid=%d error=%r", request_id, worker.proc.pid, exc)
            raise RouterError(500, "the prompt renderer died on this request", type="internal_error", code="render_failed") from None
        finally:
            # a worker that overran, died, ran out of memory (a MemoryError can leave it half-broken) or was left
            # mid-job (the client went away) is never reused
            if reply is not None and reply[0] in ("ok", "error"):
                idle.put_nowait(worker)
            else:
                task = asyncio.get_running_loop().create_task(self._replace(worker))
                self._replacing.add(task)
                task.add_done_callback(self._replacing.discard)
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "memory":
            log.warning("req=%s event=render_limit limit=memory_mb value=%d", request_id, lim.memory_mb)
            raise _limit(job, f"needed over {lim.memory_mb} MiB (prompt_render.memory_mb)")
        raise _template_error(job, reply[1])

    async def _replace(self, dead: _Worker) -> None:
        """Kill `dead` and fork its successor, off the loop (the fork, the reaping and the ready wait block), then make it idle."""
        await asyncio.to_thread(dead.kill)
        while True:
            try:
                w = await asyncio.to_thread(self._spawn_ready)
            except RuntimeError as exc:
                log.warning("event=render_worker_start_failed error=%s", exc)
                await asyncio.sleep(1.0)
                continue
            self._queue().put_nowait(w)
            log.info("event=render_worker_started pid=%d replaced=%d", w.proc.pid, dead.proc.pid)
            return

    def _spawn_ready(self) -> _Worker:
        w = self._spawn()
        self._wait_ready(w)
        return w

    def close(self) -> None:
        workers = list(self._started)
        if self._idle is not None:
            workers += _drain(self._idle)
        for w in workers:
            w.kill()


def _drain(q: asyncio.Queue[_Worker]) -> list[_Worker]:
    out: list[_Worker] = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def _param(job: Job) -> str:
    return "messages" if isinstance(job, ChatJob) else "prompt" if isinstance(job, TextJob) else "tools"


def _limit(job: Job, message: str) -> RouterError:
    param = _param(job)
    what = "compiling the tool-call constraint" if param == "tools" else "rendering the prompt"
    return RouterError(400, f"invalid '{param}': {what} {message}", code="prompt_render_limit", param=param)


def _template_error(job: Job, detail: str) -> RouterError:
    if isinstance(job, CompileJob):
        return invalid("tools", f"the tool-call constraint could not be compiled: {detail}")
    if isinstance(job, ChatJob):
        return invalid("messages", f"the chat template rejected them: {detail}")
    return invalid("prompt", f"the prompt could not be tokenised: {detail}")


async def _reply(conn: Connection) -> Any:
    """The worker's answer, read when its pipe is readable (the loop is never blocked on it)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
    return conn.recv()


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _serve(conn: Connection, tokenizer: Any, memory_bytes: int) -> None:
    """The worker: drop what the router had open, cap the address space, then answer jobs until the pipe closes."""
    keep = conn.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, _max_fd())
    for sig in (signal.SIGTERM, signal.SIGINT):  # the router's handlers write to its loop, gone here
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    try:
        tokenizer.encode("warm up", add_special_tokens=False)
        limit = _vm_bytes() + memory_bytes
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    except Exception as exc:  # noqa: BLE001 - reported to the router
        conn.send(("failed", repr(exc)))
        return
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if isinstance(job, ChatJob):
                text = tokenizer.apply_chat_template(job.messages, tokenize=False, **job.kwargs)
                answer: Any = list(tokenizer.encode(text, add_special_tokens=False))
            elif isinstance(job, TextJob):
                answer = list(tokenizer.encode(job.text, add_special_tokens=job.add_special_tokens))
            else:
                answer = compile_problem(job)
            conn.send(("ok", answer))
        except MemoryError:
            conn.send(("memory", ""))
        except Exception as exc:  # noqa: BLE001 - the template raised: the client's messages do not fit it
            conn.send(("error", str(exc)[:500]))


def _max_fd() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
