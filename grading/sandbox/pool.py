"""A pool of sandboxed Python processes that run one user grader.

Each sandbox is ``bwrap`` (bubblewrap) running the system interpreter on
:mod:`grading.sandbox.child_main`, as an unprivileged user, with:

- namespaces: user, pid, network (only a loopback of its own), ipc, uts, cgroup; a fresh mount
  namespace whose root holds ``/usr`` read-only (the interpreter and its standard library),
  ``/proc``, a minimal ``/dev`` and a private size-capped ``/tmp``, and nothing else: no
  ``/etc``, no home, no worker files, data directory, checkpoints or sockets;
- an empty environment (no database URL, keys or tokens);
- rlimits set before bubblewrap starts (inherited by everything inside): address space, CPU
  time (per call: the child moves the soft limit before each), processes of the sandbox user,
  file size and open files;
- a seccomp filter (``grading.sandbox.seccomp``) refusing system calls a grader never needs
  (ptrace, bpf, new namespaces, mounts, keyrings, io_uring, ...);
- a new session, killed with its parent (``--die-with-parent``).

The parent bounds what it reads (``max_output_bytes`` a reply) and waits at most
``call_timeout_s`` a call; a sandbox that overruns, dies, or answers nonsense is killed and
replaced, and that sample scores 0 with the failure counted. Nothing a grader does reaches the
worker beyond its reply.

Every sandbox runs in a slot of the process's :class:`~grading.sandbox.capacity.SandboxCapacity`
(taken before it starts, given back when it is killed), so the processes of all sandboxes stay
within what the host allows; a start the host still refuses (fork fails, the sandbox user's
process limit) is tried again, then reported as :class:`SandboxBusy`, never raised raw.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import selectors
import signal
import subprocess
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grading.sandbox.capacity import SandboxCapacity, process_capacity
from grading.sandbox.command import DiedAtStart, start_process
from grading.sandbox.errors import SandboxBusy, SandboxError
from grading.sandbox.seccomp import program_fd, seccomp_program
from grading.sandbox.settings import SandboxSettings

__all__ = ["SandboxBusy", "SandboxError", "SandboxPool", "SandboxVerdict"]

MAX_ERROR_CHARS = 500
Failure = Literal["error", "timeout"]


@dataclass(frozen=True)
class SandboxVerdict:
    """One call's outcome: the score (0 when it failed), why it failed, and the grader's own
    error message (or the sandbox's reason) when it did."""

    score: float
    failure: Failure | None = None
    error: str | None = None
    value: str | None = None  # a tool call's result (pools made with ``call``)


@dataclass
class _Sandbox:
    process: subprocess.Popen[bytes]
    slot: int
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
    """Up to ``processes`` sandboxes loaded with one grader ``source``, graded batch by batch.

    On a worker its sandboxes take slots of ``capacity`` (default: this process's; a worker runs
    one job, so only the process's total applies): a batch waits for its first slot (or raises
    SandboxBusy) and takes more only if they are free now. They stay for the next batch unless
    every slot is held then: a pool idle between batches must not keep another grader of the
    same job (graded after it, on the same thread) waiting for a slot it will never give back.

    Given ``slot`` (one a request already holds, the API's), it runs one sandbox in that slot,
    stopped after each batch; the slot is its owner's to give back."""

    def __init__(
        self,
        source: str,
        settings: SandboxSettings,
        *,
        capacity: SandboxCapacity | None = None,
        slot: int | None = None,
        call: str | None = None,
    ) -> None:
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
        self.capacity = capacity if capacity is not None else process_capacity(settings)
        self.slot = slot
        self.call = call  # a tool's function name: the pool runs call_tool, not grade
        self._bwrap = bwrap
        self._sandboxes: list[_Sandbox] = []

    # ------------------------------------------------------------------ lifecycle

    def _grow(self, wanted: int) -> None:
        """Up to ``wanted`` sandboxes: the first one waits for a slot (SandboxBusy when none
        comes), the others start only in slots free now."""
        if self.slot is not None:
            if not self._sandboxes:
                self._sandboxes.append(self._spawn(self.slot))
            return
        while len(self._sandboxes) < wanted:
            slot = self.capacity.acquire(None, wait=not self._sandboxes)
            if slot is None:
                return
            try:
                self._sandboxes.append(self._spawn(slot))
            except BaseException:
                self.capacity.release(slot)
                raise

    def _spawn(self, slot: int) -> _Sandbox:
        """A started sandbox with the grader loaded, in ``slot``. A start that dies or that the
        host refuses is tried again for up to ``startup_timeout_s``: the processes of a sandbox
        just killed (a fork bomb's) take a moment to go, and until then the sandbox user's
        process limit refuses new ones. A grader whose source fails to load is not retried."""
        deadline = time.monotonic() + self.settings.startup_timeout_s
        delay = 0.05
        while True:
            try:
                return self._start(slot)
            except DiedAtStart:
                if time.monotonic() + delay > deadline:
                    raise SandboxBusy(
                        "the sandbox could not start (the host's process or memory limit, "
                        "GRPO_SANDBOX_MAX_PROCESSES or GRPO_SANDBOX_MEMORY_MB); retry later",
                        limit="GRPO_SANDBOX_MAX_PROCESSES",
                        per_project=False,
                        retry_after_s=math.ceil(self.settings.call_timeout_s),
                    ) from None
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    def _start(self, slot: int) -> _Sandbox:
        # The seccomp program goes to bubblewrap on a file descriptor, which it installs just
        # before it runs the interpreter (so bubblewrap's own setup is not filtered).
        seccomp_fd = program_fd() if self.settings.seccomp else None
        try:
            process = start_process(self.settings, self._bwrap, seccomp_fd)
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        sandbox = _Sandbox(process, slot)
        setup = {"source": self.source, "cpu_s": self.settings.cpu_s, "call": self.call}
        self._write(sandbox, setup)
        reply = self._read_one(sandbox, time.monotonic() + self.settings.startup_timeout_s)
        if not isinstance(reply, dict) or reply.get("ready") is not True:
            sandbox.kill()
            if not isinstance(reply, dict):
                raise DiedAtStart(str(reply))
            why = reply.get("error")
            raise SandboxError(f"the grader did not load: {str(why)[:MAX_ERROR_CHARS]}")
        return sandbox

    def close(self) -> None:
        """Kill every sandbox and give back the slots the pool took."""
        sandboxes, self._sandboxes = self._sandboxes, []
        for sandbox in sandboxes:
            sandbox.kill()
            if self.slot is None:
                self.capacity.release(sandbox.slot)

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
        if self.call is not None:
            raise ValueError("this pool runs a tool: use call_tool")
        return self._run([{"sample": s, "item": i} for s, i in zip(samples, items, strict=True)])

    def call_tool(self, arguments: Sequence[Mapping[str, Any]]) -> list[SandboxVerdict]:
        """Call the pool's tool function once per ``arguments`` (keywords); each verdict's
        ``value`` is the result text, or ``failure``/``error`` say why there is none. Same
        limits and parallelism as :meth:`grade`."""
        if self.call is None:
            raise ValueError("this pool runs a grader: use grade")
        return self._run([{"arguments": dict(a)} for a in arguments])

    def _run(self, requests: list[dict[str, Any]]) -> list[SandboxVerdict]:
        if not requests:
            return []
        try:
            return self._calls(requests)
        finally:
            if self.slot is not None or self.capacity.full():
                self.close()

    def _calls(self, requests: list[dict[str, Any]]) -> list[SandboxVerdict]:
        n = len(requests)
        verdicts: list[SandboxVerdict | None] = [None] * n
        self._grow(min(self.settings.processes, n))
        wanted = min(len(self._sandboxes), n)
        share = math.ceil(n / wanted)
        queues = {k: deque(range(k * share, min(n, (k + 1) * share))) for k in range(wanted)}
        # sandbox -> (sample index, deadline, request id)
        in_flight: dict[int, tuple[int, float, str]] = {}

        def start_next(k: int) -> None:
            while queues[k]:
                index = queues[k].popleft()
                # Random per request: code in a sandbox cannot write the reply of a later one.
                request_id = secrets.token_hex(16)
                request = {"id": request_id, **requests[index]}
                if self._write(self._sandboxes[k], request):
                    deadline = time.monotonic() + self.settings.call_timeout_s
                    in_flight[k] = (index, deadline, request_id)
                    return
                verdicts[index] = self._replace(k, "error", "the sandbox died")

        for k in range(wanted):
            start_next(k)
        while in_flight:
            now = time.monotonic()
            for k, (index, deadline, _) in list(in_flight.items()):
                if now >= deadline:
                    del in_flight[k]
                    verdicts[index] = self._replace(k, "timeout", "the call ran out of time")
                    start_next(k)
            if not in_flight:
                break
            wait = max(0.0, min(d for _, d, _ in in_flight.values()) - time.monotonic())
            with selectors.DefaultSelector() as sel:
                for k in in_flight:
                    stdout = self._sandboxes[k].process.stdout
                    assert stdout is not None
                    sel.register(stdout.fileno(), selectors.EVENT_READ, k)
                ready = [key.data for key, _ in sel.select(wait)]
            for k in ready:
                reply = self._take_reply(k, expected_id=in_flight[k][2])
                if reply is None:
                    continue  # a partial line: wait for the rest
                index, _, _ = in_flight.pop(k)
                verdicts[index] = reply
                start_next(k)
        return [v if v is not None else SandboxVerdict(0.0, "error") for v in verdicts]

    def _take_reply(self, k: int, expected_id: str) -> SandboxVerdict | None:
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
        if not forged and "value" in reply:  # and a tool's result as text
            forged = self.call is None or not isinstance(reply["value"], str)
        if forged:
            return self._replace(k, "error", "the sandbox wrote something that is not a reply")
        if "spent" in reply:  # processes left behind: never reuse this sandbox
            why = str(reply.get("error") or reply["spent"])[:MAX_ERROR_CHARS]
            return self._replace(k, "error", why)
        if "error" in reply:
            return SandboxVerdict(0.0, "error", str(reply["error"])[:MAX_ERROR_CHARS])
        if self.call is not None:
            if "value" not in reply:
                return SandboxVerdict(
                    0.0, "error", "the sandbox wrote something that is not a reply"
                )
            return SandboxVerdict(0.0, value=reply["value"])
        score = reply.get("score")
        if not isinstance(score, float) or not 0.0 <= score <= 1.0:  # also NaN
            return SandboxVerdict(
                0.0, "error", f"grade returned {score!r:.60}, not a score in [0, 1]"
            )
        return SandboxVerdict(float(score))

    def _replace(self, k: int, failure: Failure, why: str) -> SandboxVerdict:
        """Kill sandbox ``k`` (a call overran or it broke) and start a fresh one in its place
        (SandboxError if that fails: the grader can no longer run at all)."""
        old = self._sandboxes[k]
        old.kill()
        # The same slot: a dead sandbox left in the list is killed again, and its slot given
        # back, by close().
        self._sandboxes[k] = self._spawn(old.slot)
        return SandboxVerdict(0.0, failure, why)
