"""The Linux calls that put agent episodes in a sandbox: namespaces, a root file system of only
what the agent needs to import, read-only, an identity of its own, no capabilities, a seccomp
filter. Standard library only (ctypes): it runs in the zygote, whatever interpreter that is.

Three tiers (docs/environments-and-agents.md "Threat model"):
- the launcher (`launch_zygote`): the pool's subprocess; makes the pid, network, IPC and UTS
  namespaces, forks the zygote into them, and, when it is root, maps the zygote's user namespace
  onto two unused host uids (`uid_map`), then only waits;
- the zygote (`enter_zygote`): a mount namespace whose root is a tmpfs holding read-only binds of
  the interpreter, its packages and the agent's code (`visible`), a /proc of its own pid
  namespace, a private /tmp; then a user namespace of its own (uid 0 inside = the first host uid);
- each episode (`enter_episode`, in a fork of a fork of the zygote): pid, network, IPC, UTS and
  mount namespaces of its own, a fresh /tmp, /dev/shm and /proc, uid 1 inside (the second host
  uid) with no capabilities (bounding set included), no_new_privs, and the seccomp filter.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import tempfile

from sandbox._linux import (MNT_DETACH, MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_RDONLY, MS_REC,
                            MS_REMOUNT, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, PR_SET_SECCOMP, mount,
                            prctl, syscall, umount, unshare)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_ST_FLAGS = {os.ST_RDONLY: MS_RDONLY, os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC}
SECCOMP_MODE_FILTER = 2
EPISODE_UID = 1  # inside the user namespace: the episode's identity (the zygote is 0)
DEVICES = ("null", "zero", "full", "random", "urandom")


# -- the launcher --------------------------------------------------------------------------------
def launcher_namespaces(privileged: bool) -> None:
    """The launcher's namespaces, which the zygote it forks next is born in. Unprivileged, a user
    namespace comes first (uid 0 inside = this user), so that it may make the others."""
    if not privileged:
        uid, gid = os.getuid(), os.getgid()
        unshare(CLONE_NEWUSER)
        _write(f"/proc/self/setgroups", "deny")
        _write(f"/proc/self/uid_map", f"0 {uid} 1")
        _write(f"/proc/self/gid_map", f"0 {gid} 1")
    unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)


def map_user(pid: int, uids: list[int], gids: list[int]) -> None:
    """Root's side of the zygote's user namespace: uids (gids) 0 and 1 inside are the two host ids
    given (the zygote's and its episodes'), which nothing else on the host uses."""
    _write(f"/proc/{pid}/uid_map", "".join(f"{i} {u} 1\n" for i, u in enumerate(uids)))
    _write(f"/proc/{pid}/gid_map", "".join(f"{i} {g} 1\n" for i, g in enumerate(gids)))


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# -- the zygote ----------------------------------------------------------------------------------
def enter_root(visible: list[str], hidden: list[str], tmp_bytes: int, names: list[tuple[str, str]] = ()) -> str:
    """A mount namespace whose root holds only /usr and `visible` (read-only binds at their own
    paths: files or directories), minimal /dev and /etc, a /proc of this pid namespace and a private /tmp; then
    `hidden` paths (the run directory...) covered with an empty read-only tmpfs where a bind made
    them visible; `names`, (host name, address) of the endpoints, in /etc/hosts. The old root is
    gone afterwards. Returns the host folder the new root was built
    on (empty on the host: the launcher removes it)."""
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    new = tempfile.mkdtemp(prefix="rlpost-agents-root-")
    mount("rlpost-agents", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m")
    os.makedirs(f"{new}/tmp")  # first: code that lives under /tmp is bound inside it
    mount("tmpfs", f"{new}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={tmp_bytes}")
    for path in sorted({"/usr", "/etc/ld.so.cache", *visible}, key=len):  # the system's programs and libraries too
        if os.path.exists(path):
            _bind_ro(path, new + path)
    for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin"):  # Debian's usr-merge links, or the real dirs
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), f"{new}/{name}")
        elif os.path.isdir("/" + name):
            _bind_ro("/" + name, f"{new}/{name}")
    for name in DEVICES:
        _bind_ro(f"/dev/{name}", f"{new}/dev/{name}", writable=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(f"{new}/etc", exist_ok=True)
    with open(f"{new}/etc/hosts", "w") as f:
        f.write("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in names))
    with open(f"{new}/etc/passwd", "w") as f:
        f.write("root:x:0:0:zygote:/tmp:/bin/false\nagent:x:1:1:agent:/tmp:/bin/false\n")
    with open(f"{new}/etc/group", "w") as f:
        f.write("root:x:0:\nagent:x:1:\n")
    for d in ("proc", "dev/shm", ".old"):
        os.makedirs(f"{new}/{d}", exist_ok=True)
    mount("proc", f"{new}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in hidden:
        if os.path.isdir(new + path):
            mount("tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=0555")
    syscall("pivot_root", new.encode(), (new + "/.old").encode())
    os.chdir("/")
    umount("/.old")  # (lazily: the old root is busy)
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return new


def _bind_ro(src: str, dst: str, writable: bool = False) -> None:
    """Bind `src` at `dst` (made as a directory or an empty file), read-only unless `writable`;
    the source mount's nosuid/nodev/noexec are kept (a user namespace may not drop them)."""
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst):
            open(dst, "w").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    flags = sum(ms for st, ms in _ST_FLAGS.items() if os.statvfs(src).f_flag & st)
    if not writable:
        flags |= MS_RDONLY
    mount(None, dst, None, MS_REMOUNT | MS_BIND | flags)


def become_zygote_user() -> None:
    """After `map_user` (root's launcher) or in the launcher's own user namespace: uid and gid 0
    inside, no supplementary groups (they would be the host's)."""
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


# -- an episode ----------------------------------------------------------------------------------
def episode_namespaces() -> None:
    """The episode's worker: network, IPC and UTS namespaces of its own (it and its episode), and a
    pid namespace whose init is the episode process it forks next."""
    unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID)
    loopback_up()


def loopback_up() -> None:
    """`ip link set lo up`, by ioctl: a new network namespace has its loopback down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, req))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 0x1))  # SIOCSIFFLAGS, IFF_UP


def add_address(ip: str) -> None:
    """`ip addr add IP/32 dev lo`, by netlink: an endpoint on another host is relayed at its own
    address inside the episode's network, so a URL naming it works unchanged."""
    if ipaddress_is_loopback(ip):
        return
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as nl:  # NETLINK_ROUTE
        packed = socket.inet_aton(ip)
        attrs = b"".join(struct.pack("HH", 8, kind) + packed for kind in (2, 1))  # IFA_LOCAL, IFA_ADDRESS
        body = struct.pack("BBBBI", socket.AF_INET, 32, 0, 0, socket.if_nametoindex("lo")) + attrs
        flags = 0x1 | 0x4 | 0x400 | 0x200  # NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
        nl.send(struct.pack("IHHII", 16 + len(body), 20, flags, 1, 0) + body)  # RTM_NEWADDR
        reply = nl.recv(4096)
        error = struct.unpack("i", reply[16:20])[0]  # the ack: an nlmsgerr, 0 on success
        if error:
            raise OSError(-error, f"adding {ip} to the episode's loopback: {os.strerror(-error)}")


def ipaddress_is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "0.0.0.0")


def enter_episode(tmp_bytes: int, seccomp: bytes | None, mapped: bool, cover: list[str], keep: list[str]) -> None:
    """In the episode process (init of its pid namespace): a mount namespace of its own with a fresh
    /tmp, /dev/shm and /proc (only its own processes), the zygote's read-only `keep` binds under
    them (the agent's code in a folder under /tmp) put back, `cover` (the relay's sockets) hidden
    under an empty tmpfs; then uid 1 (when `mapped`) with every capability dropped, bounding set
    included, no_new_privs and the seccomp filter. Dies with its worker."""
    prctl(PR_SET_PDEATHSIG, 9, what="prctl(PR_SET_PDEATHSIG)")
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    kept = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in keep if os.path.exists(path)]
    for target in ("/tmp", "/dev/shm"):
        mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={tmp_bytes}")
    for path, fd in kept:  # through /proc/self/fd: the zygote's /proc is still the one mounted
        _bind_ro(f"/proc/self/fd/{fd}", path)
        os.close(fd)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in cover:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=0555")
    drop_privileges(mapped)
    prctl(PR_SET_PDEATHSIG, 9, what="prctl(PR_SET_PDEATHSIG)")  # cleared by the uid change
    if seccomp:
        install_seccomp(seccomp)


def drop_privileges(mapped: bool) -> None:
    """No capability left, none to regain: the bounding set emptied, then uid 1 (setuid from 0 to
    non-zero clears the rest) or, in a single-uid namespace, every set cleared by capset."""
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        prctl(PR_CAPBSET_DROP, cap, what=f"prctl(PR_CAPBSET_DROP, {cap})")
    if mapped:
        os.setgroups([])
        os.setresgid(EPISODE_UID, EPISODE_UID, EPISODE_UID)
        os.setresuid(EPISODE_UID, EPISODE_UID, EPISODE_UID)
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = bytes(24)  # two {effective, permitted, inheritable} triples, all empty
    syscall("capset", ctypes.c_char_p(header), ctypes.c_char_p(data))
    prctl(PR_SET_NO_NEW_PRIVS, 1, what="prctl(PR_SET_NO_NEW_PRIVS)")


def install_seccomp(bpf: bytes) -> None:
    """Load a classic-BPF seccomp program (sandbox._seccomp's export format: 8-byte instructions)."""
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = struct.pack("HxxxxxxQ", len(bpf) // 8, ctypes.addressof(buf))
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.cast(ctypes.c_char_p(prog), ctypes.c_void_p).value,
          what="prctl(PR_SET_SECCOMP)")
