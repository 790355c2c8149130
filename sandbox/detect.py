"""What isolation this host offers, probed once per process, and a clear refusal when it is short.

The process backend must never silently run untrusted code with less isolation than it claims,
so it calls `require_isolation(probe_host(...))` at construction. The probe is cheap (one
bubblewrap start, a few cgroup mkdir/rmdir, no perf binary) and cached.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

from sandbox import _bwrap, _cgroup
from sandbox.backend import SandboxUnavailable

_UNSAFE_HINT = ("or set sandbox.backend=unsafe_local to run untrusted code WITHOUT isolation "
                "(only for code you trust)")


@dataclass(frozen=True)
class HostSupport:
    root: bool
    bwrap_path: str | None          # resolved path, None when not found
    bwrap_version: str = ""
    bwrap_usable: bool = False      # a sandbox with every namespace started as the slot uid
    bwrap_as_pid_1: bool = False    # --as-pid-1 (a box's supervisor as the sandbox's init)
    bwrap_error: str = ""
    user_namespaces: bool = False
    cgroup_memory: bool = False     # v1 memory controller, writable
    cgroup_swap: bool = False       # memory.memsw.* (swap counted in the cap)
    cgroup_pids: bool = False
    cgroup_cpuacct: bool = False
    seccomp: bool = False           # pyseccomp/libseccomp can build the filter, kernel has seccomp
    seccomp_error: str = ""
    valgrind_path: str | None = None
    perf_hw_counters: bool = False  # hardware instruction counter (absent in most VMs)


def _userns_enabled() -> bool:
    checks = {"/proc/sys/user/max_user_namespaces": lambda v: int(v) > 0,
              "/proc/sys/kernel/unprivileged_userns_clone": lambda v: int(v) == 1,
              "/proc/sys/kernel/apparmor_restrict_unprivileged_userns": lambda v: int(v) == 0}
    for path, ok in checks.items():
        if os.path.exists(path):
            with open(path) as f:
                if not ok(f.read().strip()):
                    return False
    return True


def _cgroup_writable(controller: str) -> bool:
    """mkdir/rmdir a probe cgroup under our parent in that hierarchy."""
    base = os.path.join(_cgroup.ROOT, controller)
    if not os.path.isdir(base) or not os.access(base, os.W_OK):
        return False
    probe = os.path.join(base, _cgroup.PARENT, f"probe-{os.getpid()}")
    try:
        os.makedirs(probe, exist_ok=True)
        os.rmdir(probe)
    except OSError:
        return False
    return True


def _bwrap_try(bwrap: str, uid: int | None) -> tuple[bool, str]:
    """Start the same kind of sandbox the backend uses (all namespaces, as the slot uid)."""
    argv = _bwrap.argv(bwrap, None, ["/usr/bin/true"], tmp_bytes=1 << 20)
    kw: dict = {}
    if uid is not None and os.geteuid() == 0:
        kw = {"user": uid, "group": uid, "extra_groups": []}
    try:
        p = subprocess.run(argv, capture_output=True, timeout=10, env=_bwrap.ENV, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if p.returncode != 0:
        return False, p.stderr.decode(errors="replace").strip() or f"exit {p.returncode}"
    return True, ""


def _seccomp_ok() -> tuple[bool, str]:
    with open("/proc/self/status") as f:
        if "Seccomp:" not in f.read():
            return False, "kernel without seccomp"
    try:
        from sandbox._seccomp import filter_bpf
        filter_bpf()
    except (ImportError, RuntimeError, OSError) as e:
        return False, f"{type(e).__name__}: {e}"
    return True, ""


class _PerfAttr(ctypes.Structure):
    """struct perf_event_attr up to PERF_ATTR_SIZE_VER0 (64 bytes), which every kernel accepts."""

    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64),
                ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
                ("config1", ctypes.c_uint64)]


_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}


def _perf_hw_counters() -> bool:
    """Can this process count its instructions (PERF_TYPE_HARDWARE/INSTRUCTIONS)? No PMU in a
    VM makes perf_event_open fail (ENOENT/EOPNOTSUPP): detected, not assumed."""
    nr = _NR_PERF_EVENT_OPEN.get(os.uname().machine)
    if nr is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _PerfAttr(type=0, size=ctypes.sizeof(_PerfAttr), config=1,
                     flags=1 | (1 << 5) | (1 << 6))   # disabled, exclude_kernel, exclude_hv
    fd = libc.syscall(nr, ctypes.byref(attr), 0, -1, -1, 0)
    if fd < 0:
        return False
    os.close(fd)
    return True


@functools.lru_cache(maxsize=None)
def probe_host(bwrap: str = "bwrap", uid: int | None = 60000) -> HostSupport:
    """Probe (once per process and arguments) what the process backend needs."""
    root = os.geteuid() == 0
    path = shutil.which(bwrap)
    version, usable, err, as_pid_1 = "", False, "not found", False
    if path:
        v = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        version = v.stdout.strip()
        usable, err = _bwrap_try(path, uid)
        h = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10)
        as_pid_1 = "--as-pid-1" in h.stdout + h.stderr
    sec_ok, sec_err = _seccomp_ok()
    return HostSupport(
        root=root,
        bwrap_path=path,
        bwrap_version=version,
        bwrap_usable=usable,
        bwrap_as_pid_1=as_pid_1,
        bwrap_error=err,
        user_namespaces=_userns_enabled(),
        cgroup_memory=_cgroup_writable("memory"),
        cgroup_swap=_cgroup.has_swap_accounting(),
        cgroup_pids=_cgroup_writable("pids"),
        cgroup_cpuacct=_cgroup_writable("cpuacct"),
        seccomp=sec_ok,
        seccomp_error=sec_err,
        valgrind_path=shutil.which("valgrind"),
        perf_hw_counters=_perf_hw_counters(),
    )


def missing(support: HostSupport) -> list[str]:
    """One line per missing primitive, each naming the fix."""
    out = []
    if not support.root:
        out.append("not running as root: per-run cgroups, tmpfs work dirs and slot uids need root "
                   "(run the sandbox workers as root, or use sandbox.backend=docker)")
    if support.bwrap_path is None:
        out.append("bubblewrap not found: apt-get install bubblewrap (or pass the path of bwrap)")
    elif not support.bwrap_usable:
        out.append(f"bubblewrap at {support.bwrap_path} cannot start a sandbox "
                   f"({support.bwrap_error}); enable unprivileged user namespaces: "
                   "sysctl -w user.max_user_namespaces=10000 kernel.unprivileged_userns_clone=1")
    if not support.user_namespaces:
        out.append("user namespaces are disabled: sysctl -w user.max_user_namespaces=10000 "
                   "(and kernel.unprivileged_userns_clone=1 / "
                   "kernel.apparmor_restrict_unprivileged_userns=0 where those exist)")
    for ok, what in ((support.cgroup_memory, "memory"), (support.cgroup_pids, "pids"),
                     (support.cgroup_cpuacct, "cpuacct")):
        if not ok:
            out.append(f"cgroup v1 '{what}' controller not writable at {_cgroup.ROOT}/{what}: "
                       "mount the cgroup v1 hierarchies (hybrid mode) with write access")
    if not support.seccomp:
        out.append(f"seccomp filter unavailable ({support.seccomp_error}): "
                   "apt-get install libseccomp2 and pip install pyseccomp")
    return out


def require_isolation(support: HostSupport) -> None:
    """Raise SandboxUnavailable naming every missing primitive and its fix."""
    problems = missing(support)
    if problems:
        raise SandboxUnavailable("the process sandbox cannot isolate untrusted code on this host:\n  - "
                                 + "\n  - ".join(problems) + "\n" + _UNSAFE_HINT)
