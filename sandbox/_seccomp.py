"""The seccomp filter bubblewrap installs right before it execs into the sandbox.

Namespaces already hide the network, other processes and the host file system; the filter
removes kernel attack surface a compiler, an interpreter, valgrind or a judged program never
needs (new namespaces, mounts, tracing, BPF, keyrings, io_uring, perf, module loading...), all
sockets but AF_UNIX, and the IPC objects that could outlive a command (System V, POSIX message
queues). Denied calls fail with EPERM, so well-behaved programs see an ordinary error. Calls
of another ABI (i386 `int 0x80`, x32) kill the process (SIGSYS), which the backend reports as a
violation. bubblewrap installs it on what it starts: the box supervisor (every command inherits
it from there) or, without one, the command itself.
"""

from __future__ import annotations

import errno
import functools
import os
import socket

DENIED = (
    # tracing / other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # kernel attack surface with no use in a judged program
    "bpf", "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "open_by_handle_at", "name_to_handle_at",
    "fanotify_init", "lookup_dcookie", "quotactl", "acct", "swapon", "swapoff", "reboot",
    "syslog", "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "vhangup", "uselib", "ustat", "sysfs",
    # System V IPC and POSIX message queues: objects that would outlive the command in the box's
    # IPC namespace (shared by its commands), and of no use to a single judged process
    "shmget", "semget", "msgget", "mq_open",
)

# clone() flags that would create namespaces (clone3 takes its flags in memory, which seccomp
# cannot inspect: it gets ENOSYS and the C library falls back to clone()).
_CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080,
}


@functools.lru_cache(maxsize=2)
def filter_bpf(unix_only: bool = True) -> bytes:
    """The filter compiled to a classic BPF program (the format bwrap's --seccomp reads).
    `unix_only=False` allows network sockets (agent episodes speak HTTP on their own loopback)."""
    import pyseccomp as sc   # imported here: a host without libseccomp fails in detect, clearly

    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        f.add_rule(deny, name)
    if unix_only:
        f.add_rule(deny, "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NEW.values():
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    fd = os.memfd_create("rlpost-seccomp-export", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as mf:
        f.export_bpf(mf)
        mf.seek(0)
        return mf.read()


def filter_fd() -> int:
    """A fresh memfd holding the filter, positioned at 0, to pass to bwrap (which reads it)."""
    fd = os.memfd_create("rlpost-seccomp", os.MFD_CLOEXEC)
    data = filter_bpf()
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
