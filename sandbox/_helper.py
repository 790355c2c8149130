"""A small trusted C helper (sandbox/helper.c) with two jobs: the launcher (host side) and
the box supervisor.

Launcher (`helper -e FD [-j FILE]... [-u ID] [-r RES:SOFT:HARD]... -- ARGV...`), run as the
caller (root for the process backend): acts on its options in order, then execs ARGV (PATH
lookup). -e: where set-up errors go (a close-on-exec pipe: empty after a successful exec, so
nothing the command writes can pass for a launcher error); -j: write "0" to a v1 cgroup `tasks`
file, which moves this (single-threaded) process there; -u: drop supplementary groups, then gid
and uid; -r: setrlimit. Any failure writes one line to FD and exits 127.
Why: a `preexec_fn` (or `user=`/`group=`) makes `subprocess` fork the whole calling process,
whose cost grows with its memory: ~1.5 ms for a bare interpreter, ~7.5 ms once torch is loaded
(a Ray actor), ~60 ms with 1 GB touched. Without them `subprocess` uses vfork (~0.5 ms whatever
the size) and the set-up happens in this tiny process instead.
Why `tasks` and not `cgroup.procs`: moving a whole thread group write-locks the kernel's global
cgroup_threadgroup_rwsem, whose first writer after a quiet spell waits for an RCU grace period
(6-17 ms on the VMs measured: the "first command after a compile is slow" effect), while a
thread moving itself skips that lock (~0.1 ms).

Supervisor (`helper supervise CTRL_FD SELF_FD`): PID 1 of a box's sandbox (bubblewrap with
--as-pid-1, see sandbox._session), as the slot uid, under the box's seccomp filter. For each
command it receives over CTRL_FD (a SOCK_SEQPACKET socket: the message below, with the
command's stdin/stdout/stderr and the run cgroups' `tasks` files as SCM_RIGHTS) it
  1. forks a child that joins the run cgroups, starts a new session, takes the pipes as
     0/1/2, sets the rlimits and execs the command (exec failure: a message on the command's
     stderr and exit 127/126, as a shell does),
  2. reaps everything until the command's main process exits, and replies with its wait status
     (or with why the child could not be set up),
  3. reaps until no child is left (the host kills what the command left), and replies again,
     saying whether /tmp and /dev/shm are still empty (else the host starts a fresh sandbox).
It cannot be signalled by what it runs (PID 1 of their pid namespace), it is not dumpable (so
/proc/1/mem, /proc/1/fd... are closed to them; ptrace is denied by seccomp anyway), and the
fds it holds are close-on-exec. It exits when the host closes CTRL_FD.

Message (structs in helper.c, mirrored by HEADER, RLIMIT and REPLY below): struct hdr, then
nrl x struct rl, then argc NUL-terminated strings; reply: struct reply.

Built once per host with the system's gcc into a directory only the current user can write
(root: /run/rlpost-sandbox), under a name hashing its source, so a changed source rebuilds. The
binary is mode 0755 (the slot uid execs it inside the sandbox through an inherited fd; the
directory stays closed). `path()` is None where that fails (no gcc, noexec directory): callers
then fall back to a `preexec_fn` and a bubblewrap per command.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import os
import shutil
import stat
import struct
import subprocess
import tempfile

MAGIC = 0x72_6C_70_31      # "rlp1"
HEADER = struct.Struct("=IIII")          # magic, nrl, argc, nfds
RLIMIT = struct.Struct("=IIQQ")          # resource, pad, soft, hard
REPLY = struct.Struct("=ii248s")         # kind, status, message
REPLY_STATUS, REPLY_ERROR, REPLY_CLEAN = 1, 2, 3
MAX_FDS = 8

SOURCE = (importlib.resources.files("sandbox") / "helper.c").read_text()


def _cache_dir() -> str:
    if os.geteuid() == 0:
        return "/run/rlpost-sandbox"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rlpost-sandbox")


def _private(path: str) -> bool:
    """Owned by us and writable by nobody else: safe to exec what it holds as us (root)."""
    st = os.lstat(path)
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


@functools.lru_cache(maxsize=1)
def path() -> str | None:
    """The helper binary, built on first use; None where it cannot be built or run."""
    directory = _cache_dir()
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    target = os.path.join(directory, f"helper-{digest}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _private(directory):
            return None
        if os.path.exists(target):
            return target if _private(target) else None
        gcc = shutil.which("gcc")
        if gcc is None:
            return None
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            src, out = os.path.join(tmp, "helper.c"), os.path.join(tmp, "helper")
            with open(src, "w") as f:
                f.write(SOURCE)
            for static in (["-static"], []):     # static: no dynamic loader at every start
                build = subprocess.run([gcc, "-O2", "-Wall", "-Werror", *static, "-o", out, src],
                                       capture_output=True, timeout=60)
                if build.returncode == 0:
                    break
            else:
                return None
            os.chmod(out, 0o755)
            if subprocess.run([out, "-e", "2", "--", "true"], timeout=10).returncode != 0:
                return None                       # e.g. a noexec file system
            os.replace(out, target)               # atomic: a concurrent builder wins or loses whole
    except (OSError, subprocess.SubprocessError):
        return None
    return target


def launch_argv(command: list[str], *, error_fd: int, join: list[str], uid: int | None,
                rlimits: list[tuple[int, int, int]]) -> list[str]:
    """The launcher command line that sets up and then execs `command` (see the module doc)."""
    tool = path()
    assert tool is not None
    out = [tool, "-e", str(error_fd)]
    for file in join:
        out += ["-j", file]
    if uid is not None:
        out += ["-u", str(uid)]
    for res, soft, hard in rlimits:
        out += ["-r", f"{res}:{soft}:{hard}"]
    return out + ["--", *command]


def command_message(argv: list[str], rlimits: list[tuple[int, int, int]], nfds: int) -> bytes:
    """What the supervisor reads for one command (the fds travel alongside)."""
    out = [HEADER.pack(MAGIC, len(rlimits), len(argv), nfds)]
    out += [RLIMIT.pack(res, 0, soft, hard) for res, soft, hard in rlimits]
    out += [arg.encode() + b"\0" for arg in argv]
    return b"".join(out)
