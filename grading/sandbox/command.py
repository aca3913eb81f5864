"""How one sandbox is started: the bubblewrap command line and the rlimits and user its
process takes before bubblewrap runs (see :mod:`grading.sandbox.pool` for what is isolated)."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import subprocess
from pathlib import Path
from typing import Any

from grading.sandbox.errors import SandboxError
from grading.sandbox.settings import SandboxSettings

__all__ = ["DiedAtStart", "bwrap_command", "limits", "start_process"]

# What a start refused for want of processes, memory or descriptors (fork's EAGAIN is the
# BlockingIOError the issue saw) gives: worth trying again once other sandboxes have gone.
_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE})


class DiedAtStart(Exception):
    """A sandbox ended before it said it was ready (no reply at all), or the host refused to
    start it (fork or exec failed for want of processes or memory)."""


_CHILD = (Path(__file__).with_name("child_main.py")).read_text()


def _tasks_of(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) that ``uid`` runs now."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
    return count


def limits(settings: SandboxSettings) -> Any:
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


def start_process(
    settings: SandboxSettings, bwrap: str, seccomp_fd: int | None
) -> subprocess.Popen[bytes]:
    """The sandbox's process (bubblewrap with its limits, an empty environment, a session of
    its own); DiedAtStart when the host refuses it for now, SandboxError otherwise."""
    try:
        return subprocess.Popen(
            bwrap_command(settings, bwrap, seccomp_fd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            preexec_fn=limits(settings),
            close_fds=True,
            pass_fds=() if seccomp_fd is None else (seccomp_fd,),
            start_new_session=True,
            env={},
        )
    except OSError as exc:
        # fork, or exec under the sandbox user's process limit, refused for now.
        if exc.errno in _TRANSIENT_ERRNOS:
            raise DiedAtStart(f"{type(exc).__name__}: {exc.strerror}") from None
        raise SandboxError(
            f"the sandbox could not start ({type(exc).__name__}: {exc.strerror})"
        ) from None
