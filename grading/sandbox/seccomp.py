"""The seccomp filter of a sandbox: system calls a grader never needs are refused (EPERM).

Namespaces decide what a grader can see; this filter shrinks what it can ask the kernel for,
so that a kernel bug behind a rarely used system call is out of its reach: tracing and reading
other processes' memory, new namespaces and mounts, keyrings, eBPF, perf events, userfaultfd,
io_uring, module and kexec loading, and the like. ``clone3`` answers ENOSYS (C libraries then
fall back to ``clone``, whose namespace flags are refused). System calls of other
architectures (x32, i386 on x86_64) kill the process: libseccomp's default for a foreign
architecture.

The filter is compiled once in the worker (libseccomp through ``pyseccomp``) and handed to
bubblewrap as a BPF program on a file descriptor (``--seccomp FD``).
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

__all__ = ["DENIED", "program_fd", "seccomp_program"]

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
    "perf_event_open", "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "unshare", "setns", "mount",
    "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "init_module", "finit_module", "delete_module",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl",
    "syslog", "open_by_handle_at", "name_to_handle_at", "fanotify_init", "lookup_dcookie",
    "personality", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "iopl", "ioperm", "vhangup", "uselib", "nfsservctl",
    "pidfd_getfd", "mbind", "migrate_pages", "move_pages", "set_mempolicy",
)  # fmt: skip

# clone(2) flags that create namespaces (CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER,
# NEWPID, NEWNET, NEWTIME): a clone asking for any of them is refused.
_CLONE_NAMESPACE_FLAGS = (
    0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80,
)  # fmt: skip


@functools.cache
def seccomp_program() -> bytes:
    """The compiled BPF program (ImportError/OSError when libseccomp is not there)."""
    import pyseccomp as seccomp

    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in DENIED:
        try:
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):  # not a system call on this architecture
            continue
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NAMESPACE_FLAGS:
        rules.add_rule(
            seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag)
        )
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


def program_fd() -> int:
    """A readable file descriptor holding the program, for ``bwrap --seccomp FD`` (the caller
    closes it once the sandbox has started)."""
    program = seccomp_program()
    fd = os.memfd_create("grader-seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
