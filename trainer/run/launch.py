"""One job on ``nproc`` ranks of this machine, started through torchrun's elastic agent: the
launcher the worker (for ``resources.devices > 1``) and ``grpo train --nproc`` share.

:func:`launch_ranks` has the call shape of ``trainer.run.loop.train`` as the worker calls it.
It owns, for one run:

- a private folder (mode 0700) holding the spec as JSON and the AF_UNIX socket of the channel
  to rank 0 (:mod:`trainer.run.relay`), with a random authkey passed in the
  environment;
- the agent, ``python -m torch.distributed.run --standalone ... -m
  trainer.run.rank_main``, in a session of its own (a Ctrl-C at the terminal reaches
  only this process, which asks rank 0 to stop through ``should_stop``) and with
  ``PR_SET_PDEATHSIG`` (killing this process kills the agent, and each rank dies with the
  agent); its output goes to this module's logger, its last lines kept for error messages;
- serving the channel **in the calling thread**, between polls of the agent: each of rank 0's
  messages runs the caller's callbacks (the worker's are not thread-safe), in order, and
  ``should_stop`` is answered from them. A callback that raises stops the ranks and the error
  propagates, as it would out of ``train``.

How it ends: rank 0's last message gives the result, or its TrainerError re-raised here with
the same reason (any other error as :class:`~trainer.run.relay.RankException`). An agent
that exits without that message raises :class:`~trainer.errors.RankFailed` naming the exit code
and the rank that failed when torchrun's report says. Every wait is bounded, and the agent is
always gone when this returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import IO, TYPE_CHECKING

import trainer
from jobspec import JobSpec
from trainer.distributed.timeout import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, dist_timeout_s
from trainer.errors import DistributedTimeout, RankFailed
from trainer.run.callbacks import Callbacks
from trainer.run.relay import (
    ADDRESS_ENV,
    AUTHKEY_ENV,
    Failed,
    Finished,
    RelayTimeout,
    deliver,
)

if TYPE_CHECKING:
    from trainer.run.loop import TrainResult

__all__ = ["DEFAULT_SAMPLE_GROUPS", "DEFAULT_TIMEOUT_S", "dist_timeout_s", "launch_ranks"]

log = logging.getLogger(__name__)

DEFAULT_SAMPLE_GROUPS = 2  # trainer.run.setup.DEFAULT_SAMPLE_GROUPS (that module loads torch)
POLL_S = 0.2  # how often the agent is looked at while rank 0 is quiet
EXIT_GRACE_S = 30.0  # after rank 0's last message, for the agent and every rank to exit
STOP_GRACE_S = 40.0  # SIGTERM to SIGKILL of the agent (it gives its ranks 30 s, then kills)
READER_JOIN_S = 5.0
TAIL_LINES = 200
PR_SET_PDEATHSIG = 1


def launch_ranks(
    spec: JobSpec,
    callbacks: Callbacks,
    *,
    nproc: int,
    output_dir: Path,
    resume_from: Path | None,
    device: str,
    sample_groups: int = DEFAULT_SAMPLE_GROUPS,
) -> TrainResult:
    """Train ``spec`` on ``nproc`` ranks (one per device); ``callbacks`` see rank 0's run.

    Raises what ``train`` raises (TrainerError with rank 0's reason), RankFailed when a rank
    died or the agent failed before rank 0 ended, RelayTimeout (``distributed_timeout``) when
    rank 0 never connected, and whatever a callback raised.
    """
    if nproc < 2:
        raise ValueError(f"launch_ranks needs nproc >= 2, got {nproc} (train runs one rank)")
    if nproc != spec.resources.devices:
        # Each rank samples its share of the job's devices: another count would train
        # another job (trainer.scoring.collect).
        raise ValueError(f"a job of {spec.resources.devices} devices cannot run on {nproc} ranks")
    timeout = dist_timeout_s()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # Pid files of an earlier launch name processes that are gone (or pids reused since).
    shutil.rmtree(output_dir / "ranks", ignore_errors=True)
    private = Path(tempfile.mkdtemp(prefix="grpo-ranks-", dir=_socket_parent()))
    try:
        spec_file = private / "spec.json"
        with os.fdopen(os.open(spec_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(spec.model_dump_json())  # the job's prompts: for this user's eyes only
        with _Channel(private / "relay.sock") as channel:
            command = _agent_command(nproc, spec_file, output_dir, resume_from, device)
            command += ["--sample-groups", str(sample_groups), "--answer-timeout", str(timeout)]
            if callbacks.applies_retention:
                command.append("--applies-retention")
            agent = _Agent(command, _agent_env(channel, timeout))
            try:
                final = _serve(agent, channel, callbacks, timeout)
            finally:
                agent.stop()
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if isinstance(final, Failed):
        cause = (
            other_rank_failure(list(agent.tail))
            if final.reason == DistributedTimeout.reason
            else None
        )
        # Rank 0's collective broke because a peer died first: name the peer, the cause.
        raise RankFailed(cause) if cause is not None else final.exception()
    if final is None:
        raise RankFailed(failure_message(agent.returncode, list(agent.tail)))
    from trainer.run.loop import TrainResult  # torch, once the ranks are done

    return TrainResult(
        final.final_step, dict(final.last_metrics), final.checkpoint_path, final.stopped_early
    )


_ROOT_CAUSE = re.compile(
    r"Root Cause.*?rank\s*:\s*(?P<rank>\d+).*?exitcode\s*:\s*(?P<code>-?\d+)"
    r"(?:.*?traceback\s*:\s*(?P<signal>Signal \d+ \(\w+\)))?",
    re.DOTALL,
)


def failure_message(returncode: int | None, tail: list[str]) -> str:
    """What RankFailed says: the agent's exit code and, from the report torchrun prints when a
    rank fails, which rank failed and how (its exit code, or the signal that killed it). No
    other output: it may hold server paths, and the worker's log has all of it."""
    agent = f"torchrun's agent exited with code {returncode}"
    found = _ROOT_CAUSE.search("\n".join(tail))
    if found is None:
        return f"a rank failed before rank 0 reported the end of the run ({agent})"
    how = f"exit code {found['code']}"
    if found["signal"]:
        how = found["signal"].replace("Signal", "killed by signal")
    return f"rank {found['rank']} failed ({how}) before the run ended; {agent}"


def other_rank_failure(tail: list[str]) -> str | None:
    """RankFailed's message when torchrun's report names a rank other than 0 as the first to
    fail (rank 0's collective error is then its consequence), else None."""
    found = _ROOT_CAUSE.search("\n".join(tail))
    if found is None or found["rank"] == "0":
        return None
    return failure_message(None, tail).replace("; torchrun's agent exited with code None", "")


def _socket_parent() -> str | None:
    """Where the private folder goes: the temp dir, unless its path would make the socket's
    address longer than AF_UNIX allows (108 bytes)."""
    return None if len(tempfile.gettempdir()) <= 64 else "/tmp"


def _agent_command(
    nproc: int, spec_file: Path, output_dir: Path, resume_from: Path | None, device: str
) -> list[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), "--max-restarts", "0",
        "-m", "trainer.run.rank_main",
        "--spec", str(spec_file), "--output-dir", str(output_dir), "--device", device,
    ]  # fmt: skip
    if resume_from is not None:
        command += ["--resume-from", str(resume_from)]
    return command


def _agent_env(channel: _Channel, timeout: float) -> dict[str, str]:
    env = dict(os.environ)
    # The ranks import the trainer this process runs, not whatever an installed copy names.
    source_root = str(Path(trainer.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    env[ADDRESS_ENV] = channel.address
    env[AUTHKEY_ENV] = channel.authkey.hex()
    env[TIMEOUT_ENV] = f"{timeout:g}"
    env["PYTHONUNBUFFERED"] = "1"  # rank output reaches the log as it is written
    return env


def _serve(
    agent: _Agent, channel: _Channel, callbacks: Callbacks, connect_timeout_s: float
) -> Finished | Failed | None:
    """Run rank 0's messages on ``callbacks`` until its last one (returned), or until the
    agent exited without it (None)."""
    deadline = time.monotonic() + connect_timeout_s
    conn: Connection | None = None
    while conn is None:
        # The agent's exit is read before the channel: once it exited, every rank has, and
        # what rank 0 sent is already there to read.
        exited = agent.returncode is not None
        conn = channel.accepted(0 if exited else POLL_S)
        if conn is None and exited:
            return None
        if conn is None and time.monotonic() > deadline:
            raise RelayTimeout(f"rank 0 did not connect within {connect_timeout_s:g}s")
    with conn:
        while True:
            exited = agent.returncode is not None
            try:
                message = conn.recv() if conn.poll(0 if exited else POLL_S) else None
            except (EOFError, OSError):  # rank 0 exited without its last message
                agent.wait(EXIT_GRACE_S)
                return None
            if message is None:
                if exited:
                    return None  # every rank is gone and nothing is left to read
                continue
            if deliver(message, callbacks, conn):
                assert isinstance(message, Finished | Failed)
                agent.wait(EXIT_GRACE_S)
                return message


class _Channel:
    """The listening end of rank 0's channel. A thread only accepts (and authenticates) the
    connection; the caller's thread reads it."""

    def __init__(self, path: Path) -> None:
        self.address = str(path)
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self._accepted: queue.Queue[Connection] = queue.Queue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="grpo-relay-accept", daemon=True)
        self._thread.start()

    def __enter__(self) -> _Channel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, AuthenticationError):
                self._closing.wait(0.05)  # a peer without the key, or close() waking us
                continue
            if self._closing.is_set():
                conn.close()
                return
            self._accepted.put(conn)
            return  # one connection: rank 0's

    def accepted(self, timeout: float) -> Connection | None:
        try:
            return self._accepted.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._closing.set()
        if self._thread.is_alive():
            # accept() does not return on close(): a bare connection (which then fails the
            # handshake) wakes it.
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
                wake.settimeout(READER_JOIN_S)
                wake.connect(self.address)
            self._thread.join(READER_JOIN_S)
        self._listener.close()
        while (conn := self.accepted(0)) is not None:
            conn.close()


def _die_with_parent(parent: int, prctl: Callable[..., int]) -> None:
    """The agent's preexec_fn: SIGKILL when the thread that started it exits (the caller of
    launch_ranks waits for the agent in that same thread), or at once if the parent is gone
    already. It runs between fork and exec, so it only calls a function bound beforehand."""
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class _Agent:
    """torchrun's elastic agent as a child process, its output logged line by line."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        preexec = None
        if sys.platform.startswith("linux"):
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            parent = os.getpid()
            preexec = lambda: _die_with_parent(parent, prctl)  # noqa: E731
        self._proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec,
        )
        log.info("ranks: started torchrun's agent (pid %s)", self._proc.pid)
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), name=f"grpo-ranks-{name}")
            for name, stream in (("stdout", self._proc.stdout), ("stderr", self._proc.stderr))
        ]
        for reader in self._readers:
            reader.daemon = True
            reader.start()

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def _read(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        with stream:
            for raw in stream:
                line = raw.decode("utf-8", "replace").rstrip()
                self.tail.append(line)  # deque appends are atomic
                log.info("ranks: %s", line)

    def wait(self, timeout: float) -> bool:
        """Whether the agent exited within ``timeout`` seconds."""
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self) -> None:
        """End the agent if it still runs (SIGTERM: it stops its ranks; SIGKILL past the
        grace, and the ranks die with it), then collect its last output."""
        if self._proc.poll() is None:
            log.warning("ranks: stopping torchrun's agent (pid %s)", self._proc.pid)
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
            if not self.wait(STOP_GRACE_S):
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                self.wait(STOP_GRACE_S)
        for reader in self._readers:
            reader.join(READER_JOIN_S)
        log.info("ranks: torchrun's agent exited with %s", self._proc.returncode)
