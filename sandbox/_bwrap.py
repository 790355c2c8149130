"""The bubblewrap command line: which parts of the host a sandboxed command sees.

Only /usr (read-only) and the usr-merge links (/bin, /lib, /lib64, /sbin) are visible, plus a
private /tmp, /proc and a minimal, read-only /dev (with a private /dev/shm), and the work dir
at `WORKDIR` (read-write, cwd); the sandbox's root itself is read-only. So the only writable
places are the work dir, /tmp and /dev/shm (a box whose command left anything in the latter two
gets a fresh sandbox for its next command, see sandbox._session).
/etc, /root, /home, /var, /work, /run... are absent: gcc/g++ (cc1, as, collect2, ld), python3
(-I / -S) and valgrind were checked to need none of them (without /etc/ld.so.cache the loader
falls back to its built-in library dirs, which on Debian include the multiarch ones).
"""

from __future__ import annotations

import os

WORKDIR = "/box"      # where the work dir appears inside the sandbox
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
       "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
_ROOT_LINKS = ("bin", "lib", "lib32", "lib64", "libx32", "sbin")


def system_mounts() -> list[str]:
    """/usr read-only and, for each top-level dir Debian keeps (as a usr-merge symlink or a real
    dir), the same link or a read-only bind."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in _ROOT_LINKS:
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def argv(bwrap: str, workdir: str | None, command: list[str], seccomp_fd: int | None = None,
         info_fd: int | None = None, tmp_bytes: int | None = None,
         as_pid_1: bool = False) -> list[str]:
    """bwrap with every namespace unshared (user, pid, net, ipc, uts, cgroup), dying with its
    parent, in a new session (no TIOCSTI on our terminal), all capabilities dropped.
    `as_pid_1`: the command itself is the pid namespace's init (the box supervisor), instead of
    bwrap's own reaper."""
    out = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
           "--hostname", "box"]
    if as_pid_1:
        out.append("--as-pid-1")
    out += system_mounts()
    size = [] if tmp_bytes is None else ["--size", str(tmp_bytes)]
    out += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev", *size, "--tmpfs", "/tmp"]
    if workdir is not None:
        out += ["--bind", workdir, WORKDIR, "--chdir", WORKDIR]
    out += ["--remount-ro", "/"]       # the sandbox's own root tmpfs: nothing to write there
    if seccomp_fd is not None:
        out += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        out += ["--info-fd", str(info_fd)]
    return out + ["--", *command]
