"""A pool of sandboxed Python processes that run one user grader.

Each sandbox is ``bwrap`` (bubblewrap) running the system interpreter on
:mod:`trainer.sandbox.child_main`, as an unprivileged user, with:

- namespaces: user, pid, network (only a loopback of its own), ipc, uts, cgroup; a fresh mount
  namespace whose root holds ``/usr`` read-only (the interpreter and its standard library),
  ``/proc``, a minimal ``/dev`` and a private size-capped ``/tmp``, and nothing else: no
  ``/etc``, no home, no worker files, data directory, checkpoints or sockets;
- an empty environment (no database URL, keys or tokens);
- rlimits set before bubblewrap starts (inherited by everything inside): address space, CPU
  time (per call: the child moves the soft limit before each), processes of the sandbox user,
  file size and open files;
- a seccomp filter (``trainer.sandbox.seccomp``) refusing system calls a grader never needs
  (ptrace, bpf, new namespaces, mounts, keyrings, io_uring, ...);
- a new session, killed with its parent (``--die-with-parent``).

The parent bounds what it reads (``max_output_bytes`` a reply) and waits at most
``call_timeout_s`` a call; a sandbox that overruns, dies, or answers nonsense is killed and
replaced, and that sample scores 0 with the failure counted. Nothing a grader does reaches the
worker beyond its reply.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import selectors
import signal
import subprocess
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.sandbox.seccomp import program_fd, seccomp_program
from trainer.sandbox.settings import SandboxSettings

__all__ = ["SandboxError", "SandboxPool", "SandboxVerdict"]

_CHILD = (Path(__file__).with_name("child_main.py")).read_text()
MAX_ERROR_CHARS = 500


class SandboxError(RuntimeError):
    """The sandbox cannot run at all here (no bubblewrap, no interpreter, disabled)."""


class _DiedAtStart(Exception):
    """A sandbox ended before it said it was ready (no reply at all)."""


Failure = Literal["error", "timeout"]


@dataclass(frozen=True)
class SandboxVerdict:
    """One call's outcome: the score (0 when it failed), why it failed, and the grader's own
    error message (or the sandbox's reason) when it did."""

    score: float
    failure: Failure | None = None
    error: str | None = None


def _tasks_of(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) that ``uid`` runs now."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
    return count


def _limits(settings: SandboxSettings) -> Any:
    """``preexec_fn`` of a sandbox: rlimits, then the unprivileged user (the order matters: a
    process may lower its limits while root, and cannot raise them once it is not).

    RLIMIT_NPROC counts every task of the user. A root worker switches the sandbox to its own
    user (``settings.uid``), whose tasks are the sandboxes'; a worker that is not root runs them
    as itself, so its own threads count too and the limit is what it runs now plus
    ``max_processes``."""
    memory = settings.memory_mb << 20
    file_size = settings.file_mb << 20
    switch = os.getuid() == 0
    processes = settings.max_processes + (0 if switch else _tasks_of(os.getuid()))

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        # The hard CPU limit bounds a sandbox's whole life; each call gets cpu_s of it.
        resource.setrlimit(resource.RLIMIT_CPU, (3600, 3600))
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if switch:
            os.setgroups([])
            os.setgid(settings.uid)
            os.setuid(settings.uid)

    return apply


def bwrap_command(
    settings: SandboxSettings, bwrap: str, seccomp_fd: int | None = None
) -> list[str]:
    """The bubblewrap command line of one sandbox (see the module docstring)."""
    seccomp = ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    return [
        bwrap,
        *seccomp,
        "--unshare-all",  # user, ipc, pid, net, uts, cgroup namespaces
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv", "PATH", "/usr/bin:/bin",
        "--setenv", "HOME", "/tmp",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin",
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(settings.tmp_mb << 20), "--tmpfs", "/tmp",
        "--remount-ro", "/",
        "--chdir", "/tmp",
        settings.python, "-I", "-S", "-c", _CHILD,
    ]  # fmt: skip


@dataclass
class _Sandbox:
    process: subprocess.Popen[bytes]
    buffer: bytearray = field(default_factory=bytearray)
    queue: deque[int] = field(default_factory=deque)
    busy_since: float | None = None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.process.kill()
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()
        with contextlib.suppress(Exception):
            self.process.wait(timeout=5)


class SandboxPool:
    """``processes`` sandboxes loaded with one grader ``source``, graded batch by batch."""

    def __init__(self, source: str, settings: SandboxSettings) -> None:
        if not settings.enabled:
            raise SandboxError(
                "python graders are turned off on this worker (GRPO_SANDBOX_ENABLED)"
            )
        bwrap = settings.resolved_bwrap()
        if bwrap is None:
            raise SandboxError(
                f"python graders need bubblewrap ({settings.bwrap!r} is not installed here)"
            )
        if settings.seccomp:
            try:
                seccomp_program()  # compiled once; a worker without libseccomp fails closed
            except (ImportError, OSError, RuntimeError) as exc:
                raise SandboxError(
                    f"python graders need libseccomp here (its filter did not build: "
                    f"{type(exc).__name__})"
                ) from None
        self.source = source
        self.settings = settings
        self._bwrap = bwrap
        self._sandboxes: list[_Sandbox] = []

    # ------------------------------------------------------------------ lifecycle

    def _spawn(self) -> _Sandbox:
        """A started sandbox with the grader loaded. A start that dies is tried again for up to
        ``startup_timeout_s``: the processes of a sandbox just killed (a fork bomb's) take a
        moment to go, and until then the sandbox user's process limit refuses new ones. A
        grader whose source fails to load is not retried."""
        deadline = time.monotonic() + self.settings.startup_timeout_s
        delay = 0.05
        while True:
            try:
                return self._start()
            except _DiedAtStart:
                if time.monotonic() + delay > deadline:
                    raise SandboxError(
                        "the sandbox could not start (its process or memory limit)"
                    ) from None
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    def _start(self) -> _Sandbox:
        # The seccomp program goes to bubblewrap on a file descriptor, which it installs just
        # before it runs the interpreter (so bubblewrap's own setup is not filtered).
        seccomp_fd = program_fd() if self.settings.seccomp else None
        try:
            process = subprocess.Popen(
                bwrap_command(self.settings, self._bwrap, seccomp_fd),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                preexec_fn=_limits(self.settings),
                close_fds=True,
                pass_fds=() if seccomp_fd is None else (seccomp_fd,),
                start_new_session=True,
                env={},
            )
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        sandbox = _Sandbox(process)
        self._write(sandbox, {"source": self.source, "cpu_s": self.settings.cpu_s})
        reply = self._read_one(sandbox, time.monotonic() + self.settings.startup_timeout_s)
        if not isinstance(reply, dict) or reply.get("ready") is not True:
            sandbox.kill()
            if not isinstance(reply, dict):
                raise _DiedAtStart(str(reply))
            why = reply.get("error")
            raise SandboxError(f"the grader did not load: {str(why)[:MAX_ERROR_CHARS]}")
        return sandbox

    def close(self) -> None:
        for sandbox in self._sandboxes:
            sandbox.kill()
        self._sandboxes = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ io

    @staticmethod
    def _write(sandbox: _Sandbox, message: Mapping[str, Any]) -> bool:
        assert sandbox.process.stdin is not None
        try:
            sandbox.process.stdin.write((json.dumps(message) + "\n").encode())
            sandbox.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return False
        return True

    def _read_one(self, sandbox: _Sandbox, deadline: float) -> Any:
        """One reply line (parsed), or a string saying why there is none."""
        assert sandbox.process.stdout is not None
        fd = sandbox.process.stdout.fileno()
        while b"\n" not in sandbox.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                if not sel.select(remaining):
                    return "timeout"
            chunk = os.read(fd, 65536)
            if not chunk:
                return "the sandbox died"
            sandbox.buffer += chunk
            if len(sandbox.buffer) > self.settings.max_output_bytes:
                return "the reply is over the output limit"
        line, _, rest = bytes(sandbox.buffer).partition(b"\n")
        sandbox.buffer = bytearray(rest)
        try:
            return json.loads(line)
        except (ValueError, RecursionError):
            return "the sandbox wrote something that is not a reply"

    # ------------------------------------------------------------------ grading

    def grade(
        self, samples: Sequence[Mapping[str, Any]], items: Sequence[Mapping[str, Any]]
    ) -> list[SandboxVerdict]:
        """Grade ``samples[i]`` of row ``items[i]``: the sandboxes work in parallel, each on a
        contiguous share, one call at a time, each call within ``call_timeout_s``."""
        if len(samples) != len(items):
            raise ValueError(f"{len(samples)} samples but {len(items)} items")
        n = len(samples)
        if n == 0:
            return []
        verdicts: list[SandboxVerdict | None] = [None] * n
        wanted = min(self.settings.processes, n)
        while len(self._sandboxes) < wanted:
            self._sandboxes.append(self._spawn())
        share = math.ceil(n / wanted)
        queues = {k: deque(range(k * share, min(n, (k + 1) * share))) for k in range(wanted)}
        in_flight: dict[int, tuple[int, float]] = {}  # sandbox -> (sample index, deadline)

        def start_next(k: int) -> None:
            while queues[k]:
                index = queues[k].popleft()
                request = {"id": index, "sample": samples[index], "item": items[index]}
                if self._write(self._sandboxes[k], request):
                    in_flight[k] = (index, time.monotonic() + self.settings.call_timeout_s)
                    return
                verdicts[index] = self._replace(k, "error", "the sandbox died")

        for k in range(wanted):
            start_next(k)
        while in_flight:
            now = time.monotonic()
            for k, (index, deadline) in list(in_flight.items()):
                if now >= deadline:
                    del in_flight[k]
                    verdicts[index] = self._replace(k, "timeout", "the call ran out of time")
                    start_next(k)
            if not in_flight:
                break
            wait = max(0.0, min(d for _, d in in_flight.values()) - time.monotonic())
            with selectors.DefaultSelector() as sel:
                for k in in_flight:
                    stdout = self._sandboxes[k].process.stdout
                    assert stdout is not None
                    sel.register(stdout.fileno(), selectors.EVENT_READ, k)
                ready = [key.data for key, _ in sel.select(wait)]
            for k in ready:
                reply = self._take_reply(k, expected_id=in_flight[k][0])
                if reply is None:
                    continue  # a partial line: wait for the rest
                index, _ = in_flight.pop(k)
                verdicts[index] = reply
                start_next(k)
        return [v if v is not None else SandboxVerdict(0.0, "error") for v in verdicts]

    def _take_reply(self, k: int, expected_id: int) -> SandboxVerdict | None:
        """Read what sandbox ``k`` wrote; its verdict once a whole reply line is in, else None.
        A sandbox that died, overflowed, or wrote anything but the reply to request
        ``expected_id`` (a grader writing on the protocol pipe itself) is replaced: a forged
        line must not shift every later reply onto the wrong sample."""
        sandbox = self._sandboxes[k]
        assert sandbox.process.stdout is not None
        chunk = os.read(sandbox.process.stdout.fileno(), 65536)
        if not chunk:
            return self._replace(k, "error", "the sandbox died (a limit was hit, or it exited)")
        sandbox.buffer += chunk
        if b"\n" not in sandbox.buffer:
            if len(sandbox.buffer) > self.settings.max_output_bytes:
                return self._replace(k, "error", "the reply is over the output limit")
            return None
        line, _, rest = bytes(sandbox.buffer).partition(b"\n")
        sandbox.buffer = bytearray(rest)
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):  # garbage, or nesting past the parser's depth
            return self._replace(k, "error", "the sandbox wrote something that is not a reply")
        forged = not isinstance(reply, dict) or reply.get("id") != expected_id
        if not forged and "score" in reply:  # the child always sends a float score
            forged = isinstance(reply["score"], bool) or not isinstance(reply["score"], float)
        if forged:
            return self._replace(k, "error", "the sandbox wrote something that is not a reply")
        if "spent" in reply:  # processes left behind: never reuse this sandbox
            why = str(reply.get("error") or reply["spent"])[:MAX_ERROR_CHARS]
            return self._replace(k, "error", why)
        if "error" in reply:
            return SandboxVerdict(0.0, "error", str(reply["error"])[:MAX_ERROR_CHARS])
        score = reply.get("score")
        if not isinstance(score, float) or not 0.0 <= score <= 1.0:  # also NaN
            return SandboxVerdict(
                0.0, "error", f"grade returned {score!r:.60}, not a score in [0, 1]"
            )
        return SandboxVerdict(float(score))

    def _replace(self, k: int, failure: Failure, why: str) -> SandboxVerdict:
        """Kill sandbox ``k`` (a call overran or it broke) and start a fresh one in its place
        (SandboxError if that fails: the grader can no longer run at all)."""
        self._sandboxes[k].kill()
        self._sandboxes[k] = self._spawn()
        return SandboxVerdict(0.0, failure, why)
