"""The heartbeat process: keeps a running job's lease whatever its trainer does.

Why a process and not a thread: the trainer runs in the worker process, and a long C call that
holds the GIL (a catastrophic regex in a grader, a tokenizer loop) stops every other thread of
that process, and its Python signal handlers, until it returns. A heartbeat thread starved that
way let the reaper re-queue a live job to the next worker, a cancel was never seen, and SIGTERM
was ignored. A separate process keeps beating, and when the trainer does not stop in time it
can end the job and kill the worker (design notes, "Worker liveness").

The runner starts one per job attempt (through `worker.lease.LeaseKeeper`) as
`python -m worker.heartbeat`, with three channels:

- stdin, worker -> heartbeat: one JSON line of config, then `done` once the trainer returned.
  EOF (or a new parent pid) means the worker is gone: the heartbeat exits and leaves the job to
  the reaper.
- stdout, heartbeat -> worker: one word per line, each at most once: `ready`, `cancel`,
  `pause`, `shutdown`, `lost`. The trainer reads them between steps (`LeaseKeeper.refresh`).
- a signal pipe, the worker's `signal.set_wakeup_fd`: CPython's C-level handler writes the
  signal number there the moment SIGTERM/SIGINT arrives, GIL or not, so the heartbeat learns of
  a shutdown even while the worker's own Python handler (Celery's) cannot run.

Every `interval` it beats (`app.jobs.repository.heartbeat`, fenced by the attempt). Once a
cancel, a pause or a shutdown signal was seen, the trainer has `stop_grace_seconds` to return;
past that, the heartbeat ends the attempt itself, fenced (cancelled, paused, or handed back to
the queue), then
SIGKILLs the worker. For a cancel it kills only once the job is recorded as cancelled; for a
shutdown it kills in any case, since the operator asked for the process to go.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

from app.core.db import make_engine, make_session_factory, session_scope
from app.jobs import repository as jobs_repo
from app.jobs.transitions import JobStatus
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

READY, CANCEL, PAUSE, SHUTDOWN, LOST = "ready", "cancel", "pause", "shutdown", "lost"
DONE = "done"
# The signals after which Celery stops taking work (warm shutdown).
STOP_SIGNALS = frozenset({int(signal.SIGTERM), int(signal.SIGINT)})
READY_TIMEOUT_S = 30.0  # the process imports the database stack: about a second when idle
EXIT_TIMEOUT_S = 15.0  # a beat in flight may wait on a slow database before `done` is read


# --------------------------------------------------------------------------- worker side


class HeartbeatProcess:
    """The worker's handle on the heartbeat process of one job attempt."""

    def __init__(
        self, settings: WorkerSettings, job_id: str, attempt: int, interval_s: float
    ) -> None:
        self._settings = settings
        self.job_id = job_id
        self.attempt = attempt
        self._interval = interval_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending = b""
        self._signal_w: int | None = None
        self._old_wakeup_fd = -1
        self._stopping = False
        self._warned_exit = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> list[str]:
        """Start the process and wait (bounded) until it beats; returns its reports so far.
        A process that cannot start is logged, not raised: the trainer's own fenced beats at
        step boundaries still keep the lease, as they did before this process existed."""
        signal_r = self._forward_signals()
        config = {
            "settings": self._settings.model_dump(mode="json"),
            "job_id": self.job_id,
            "attempt": self.attempt,
            "interval": self._interval,
            "worker_pid": os.getpid(),
            "signal_fd": signal_r,
        }
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "worker.heartbeat"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=() if signal_r is None else (signal_r,),
            )
            assert self._proc.stdin is not None and self._proc.stdout is not None
            # The settings carry the database URL: a pipe, never argv (visible to `ps`).
            self._proc.stdin.write(json.dumps(config).encode() + b"\n")
            self._proc.stdin.flush()
            os.set_blocking(self._proc.stdout.fileno(), False)
        except OSError:
            log.exception("job %s: the heartbeat process did not start", self.job_id)
            self._restore_signals()
            return []
        finally:
            if signal_r is not None:
                os.close(signal_r)
        return self._wait_ready()

    def reports(self) -> list[str]:
        """The words the process wrote since the last call (never blocks)."""
        proc = self._proc
        if proc is None or proc.stdout is None or proc.stdout.closed:
            return []
        fd = proc.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        words = [line.decode(errors="replace").strip() for line in lines if line.strip()]
        # A process that says `lost` exits on purpose; any other exit before `stop` is a fault.
        self._warned_exit |= LOST in words
        if proc.poll() is not None and not self._stopping and not self._warned_exit:
            self._warned_exit = True
            log.error(
                "job %s: heartbeat process exited (status %s); the lease is now refreshed only "
                "at step boundaries",
                self.job_id,
                proc.returncode,
            )
        return words

    def stop(self) -> list[str]:
        """Tell the process the trainer returned and wait for it to exit (bounded), so no
        escalation can follow; returns its last reports. Called before the runner ends the
        attempt: from then on only the runner ends it."""
        self._stopping = True
        proc = self._proc
        reports: list[str] = []
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):  # it exited already (lease lost)
                proc.stdin.write(f"{DONE}\n".encode())
                proc.stdin.close()
            try:
                proc.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("job %s: heartbeat process did not exit; killing it", self.job_id)
                proc.kill()
                proc.wait()
            reports = self.reports()
            if proc.stdout is not None:
                proc.stdout.close()
        self._restore_signals()
        return reports

    def _wait_ready(self) -> list[str]:
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        reports: list[str] = []
        while READY not in reports:
            left = deadline - time.monotonic()
            if left <= 0 or self._proc.poll() is not None:
                log.error("job %s: the heartbeat process is not beating", self.job_id)
                break
            select.select([self._proc.stdout.fileno()], [], [], min(left, 0.5))
            reports += self.reports()
        return reports

    def _forward_signals(self) -> int | None:
        """A pipe that receives every signal this process handles, written by CPython's C-level
        handler (`signal.set_wakeup_fd`); returns its read end for the heartbeat process. Only
        the main thread may set it (Celery's solo pool runs tasks there); elsewhere: None."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self._old_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return None
        self._signal_w = write_fd
        return read_fd

    def _restore_signals(self) -> None:
        if self._signal_w is None:
            return
        signal.set_wakeup_fd(self._old_wakeup_fd)
        os.close(self._signal_w)
        self._signal_w = None


# --------------------------------------------------------------------------- the process


class _Heartbeat:
    def __init__(self, config: dict[str, Any], inbox: bytes) -> None:
        self.settings = WorkerSettings(**config["settings"])
        self.job_id: str = config["job_id"]
        self.attempt: int = config["attempt"]
        self.interval: float = config["interval"]
        self.worker_pid: int = config["worker_pid"]
        self.signal_fd: int | None = config["signal_fd"]
        self.grace = self.settings.stop_grace_seconds
        self.sessions = make_session_factory(make_engine(self.settings.resolved_database_url))
        self.inbox = inbox
        self.said: set[str] = set()
        self.cancel_since: float | None = None
        self.pause_since: float | None = None
        self.shutdown_since: float | None = None
        self.retry_escalation_at = 0.0

    def run(self) -> int:
        log.info(
            "keeping the lease of job %s attempt %s (worker pid %s): every %.2gs, stop grace %gs",
            self.job_id,
            self.attempt,
            self.worker_pid,
            self.interval,
            self.grace,
        )
        if not self.say(READY):
            return 0
        next_beat = 0.0
        while True:
            if DONE in self.inbox.decode(errors="replace").split():
                return 0
            if os.getppid() != self.worker_pid:
                log.info("job %s: the worker is gone; the reaper takes over", self.job_id)
                return 0
            now = time.monotonic()
            if now >= next_beat:
                if not self.beat(now):
                    return 0
                next_beat = now + self.interval
            deadline = self.escalation_deadline()
            if deadline is not None and now >= max(deadline, self.retry_escalation_at):
                if self.escalate():
                    return 0
                self.retry_escalation_at = now + self.interval
            wake = min(next_beat, max(deadline or next_beat, self.retry_escalation_at))
            if not self.wait(max(0.0, wake - time.monotonic())):
                return 0

    def wait(self, timeout: float) -> bool:
        """Sleep until the timeout, a message from the worker or a signal; False once the
        worker closed its end (it died, or it is done)."""
        fds = [0] if self.signal_fd is None else [0, self.signal_fd]
        readable = select.select(fds, [], [], timeout)[0]
        if 0 in readable:
            chunk = os.read(0, 4096)
            if not chunk:
                return False
            self.inbox += chunk
        if self.signal_fd is not None and self.signal_fd in readable:
            received = os.read(self.signal_fd, 512)
            if not received:  # the worker closed its end: nothing more will come
                self.signal_fd = None
            elif STOP_SIGNALS & set(received) and self.shutdown_since is None:
                log.info("job %s: the worker got a stop signal", self.job_id)
                self.shutdown_since = time.monotonic()
                return self.say(SHUTDOWN)
        return True

    def say(self, word: str) -> bool:
        """Report to the worker once per word; False when nobody reads any more."""
        if word in self.said:
            return True
        self.said.add(word)
        try:
            os.write(1, f"{word}\n".encode())
        except OSError:  # EPIPE: the worker is gone
            return False
        return True

    def beat(self, now: float) -> bool:
        """One fenced heartbeat; False once the lease is lost."""
        try:
            with session_scope(self.sessions) as session:
                status = jobs_repo.heartbeat(session, job_id=self.job_id, attempt=self.attempt)
        except Exception as exc:  # database down: keep trying, the reaper decides
            log.warning("heartbeat of job %s failed: %s", self.job_id, exc)
            return True
        if status is None:
            log.warning("job %s attempt %s lost its lease", self.job_id, self.attempt)
            self.say(LOST)
            return False
        if status == JobStatus.CANCELLING and self.cancel_since is None:
            self.cancel_since = now
            return self.say(CANCEL)
        if status == JobStatus.PAUSING and self.pause_since is None:
            self.pause_since = now
            return self.say(PAUSE)
        if status == JobStatus.RUNNING:
            self.pause_since = None  # the pause was taken back before the trainer stopped
        return True

    def escalation_deadline(self) -> float | None:
        since = (self.cancel_since, self.pause_since, self.shutdown_since)
        seen = [t for t in since if t is not None]
        return min(seen) + self.grace if seen else None

    def escalate(self) -> bool:
        """End the attempt of a trainer that did not stop within the grace, then kill it.
        True when done (or moot); False to retry (the database is unreachable)."""
        # Imported here: the hand-back needs the broker client, which only this path uses.
        from app.core.live import TailPublisher
        from app.core.queue import CeleryDispatcher
        from worker.attempts import end_attempt, pause, release

        waited = f"the trainer did not stop within {self.grace:g}s"
        # A cancel or a pause is ended only once it is recorded: then the worker may be killed.
        # A shutdown hands the job back, and the worker is killed whatever came of it.
        recorded_first = self.cancel_since is not None or self.pause_since is not None
        try:
            if self.cancel_since is not None:
                ended = end_attempt(
                    self.sessions,
                    self.job_id,
                    self.attempt,
                    JobStatus.CANCELLED,
                    message=f"cancelled; {waited}, so its worker process was stopped",
                )
            elif self.pause_since is not None:
                ended = pause(
                    self.sessions,
                    self.job_id,
                    self.attempt,
                    f"paused at its last checkpoint; {waited}, so its worker process was stopped",
                )
            else:
                ended = release(
                    self.sessions,
                    CeleryDispatcher(self.settings),
                    self.job_id,
                    self.attempt,
                    f"worker shut down and {waited}; re-queued",
                )
        except Exception as exc:
            log.warning("job %s: could not end the attempt yet: %s", self.job_id, exc)
            return False
        if ended:
            TailPublisher(self.settings.resolved_redis_url).notify(self.job_id, "status")
        if ended or not recorded_first:
            self.kill_worker(waited)
        else:
            self.say(LOST)  # another attempt or a finish got there first: not ours to kill
        return True

    def kill_worker(self, why: str) -> None:
        if os.getppid() != self.worker_pid:
            return  # it died already; its pid may belong to someone else by now
        log.error("job %s: %s; killing worker process %s", self.job_id, why, self.worker_pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.worker_pid, signal.SIGKILL)


def _read_config() -> tuple[dict[str, Any], bytes]:
    """The config line from stdin, and whatever came after it."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(0, 65536)
        if not chunk:
            raise SystemExit(0)  # the worker died before sending it
        data += chunk
    line, rest = data.split(b"\n", 1)
    return json.loads(line), rest


def main() -> int:
    # Only the worker's signals count (they arrive through the signal pipe); a Ctrl-C or a
    # SIGTERM sent to the whole process group must not end the one process that enforces them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s heartbeat[%(process)d]: %(message)s"
    )
    config, inbox = _read_config()
    return _Heartbeat(config, inbox).run()


if __name__ == "__main__":
    raise SystemExit(main())
