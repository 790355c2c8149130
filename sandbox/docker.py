"""Docker sandbox backend: one long-lived, locked-down container per backend (per worker); each
box is a private work dir in the container's tmpfs, and every command is a `docker exec` under a
small supervisor that enforces the per-command limits.

The container (started once, ~0.2 s; `docker run` per job would cost 0.4-0.9 s):
  network_mode=none, memory == memory+swap (no swap), pids_limit, read-only root filesystem,
  a size-capped tmpfs on /tmp (exec allowed: compiled programs run there), cap_drop ALL,
  no-new-privileges, Docker's default seccomp profile, private IPC, an init process (docker-init)
  and a non-root user (10001, `sandbox` in the image) that only runs `sleep infinity` and owns the
  supervisor binary. Labels (`rlpost.sandbox`, owner pid and host) find leftovers; a new backend
  removes those whose owner process on this host is gone.

Boxes: each box gets a random unprivileged uid (2e6..2^31) of its own and a 0700 work dir
/tmp/job-<hex> created by that uid, so boxes cannot see, signal or ptrace each other, and
everything a box started can be found and killed by uid (`kill(-1)` as that uid), including
processes that left their session or made themselves non-dumpable.

Per command (`Box.run`), the supervisor (C: sandbox/docker_supervise.c, compiled with the
container's gcc into /tmp/.rlpost/supervise when the backend starts) runs as the box uid:
  - wall time: its own deadline, then SIGKILL to every process of the uid -> timed_out. A host-side
    deadline (wall + host_grace_s, 10 s) kills the same way if the supervisor never answers.
  - CPU time: RLIMIT_CPU soft = ceil(cpu_s), hard = soft + 1 (SIGXCPU, then SIGKILL) -> timed_out.
  - memory: RLIMIT_AS = memory_mb per process; the container's memory cgroup caps the sum.
  - RLIMIT_FSIZE = file_bytes (SIGXFSZ -> output_exceeded), RLIMIT_NOFILE = open_files,
    RLIMIT_NPROC = processes + 1 (the supervisor runs as the same uid and counts), RLIMIT_CORE = 0.
  - output: the program's stdout/stderr go through pipes; the supervisor forwards at most
    output_bytes of each and kills everything of the uid at the first byte over -> output_exceeded.
  - nothing outlives a command: when the main process exits, the rest of the uid is killed too;
    the supervisor is a child subreaper and reaps all of it, so cpu_s = user + sys of every
    process the command ran (RUSAGE_CHILDREN), and wall_s is measured around the main process
    (docker exec overhead excluded).
  - it reports on the last line of stderr after a marker, with a nonce the host sent as the first
    line of stdin (read before the command starts; the supervisor makes itself non-dumpable, so
    the same-uid command can neither ptrace it nor read its memory). The backend strips the line.
    A command that kills its supervisor gets no report: it is killed and reported as a
    violation (runtime error), never with numbers it wrote itself.

Detection limits (documented, best effort):
  - memory_exceeded: set when the container's cgroup recorded an OOM kill during the command
    (the job is made the OOM killer's first choice via oom_score_adj=1000), or when the command
    ended abnormally (signal or non-zero exit) with its peak virtual size / RSS at >= 90% of
    RLIMIT_AS. A program that fails one large allocation far below the limit (e.g. Python's
    MemoryError on a huge list) is not flagged: the kernel keeps no count of RLIMIT_AS refusals.
  - container memory (and the tmpfs, whose pages count against it) is shared by all boxes of one
    backend; the per-box work dir is not size-capped separately (workdir_mb is not enforced; the
    tmpfs size and RLIMIT_FSIZE are).
  - process_limit_hit: only when the container-wide pids cgroup refused a fork during the command
    (pids.events); a refusal by the per-box RLIMIT_NPROC is only seen by the program (EAGAIN).
  - RLIMIT_NPROC counts by host uid (Docker shares the host's user namespace); box uids are drawn
    at random from a 2^31 range to make a clash with any other user negligible.
  - commands of one box must not run concurrently (each command kills the uid's other processes).
"""

from __future__ import annotations

import importlib.resources
import math
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass

from sandbox.backend import Closing, SandboxError, SandboxUnavailable
from sandbox.job import ExecOutcome, Limits

DEFAULT_IMAGE = "rlpost-sandbox:bookworm"
LABEL = "rlpost.sandbox"
SUPERVISOR_DIR = "/tmp/.rlpost"
SUPERVISOR = SUPERVISOR_DIR + "/supervise"
SUPERVISOR_C = (importlib.resources.files("sandbox") / "docker_supervise.c").read_text()
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_REPORT_MARKER = b"\x1eRLPOST-SUPERVISE "
_UID_LOW, _UID_HIGH = 2_000_000, (1 << 31) - 2
_FIX = ("start an engine as root with sandbox/image/start_dockerd.sh (then build the image with "
        "sandbox/image/build_rootfs.sh), or use the bubblewrap backend: sandbox.backend=process")


class DockerSandboxError(SandboxError):
    """A sandbox operation failed for a reason outside the program (engine, container, I/O)."""


@dataclass
class _Exec:
    """One finished `docker exec` as the host saw it."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    stdout_over: bool       # more than the cap arrived (the rest was dropped)
    stderr_over: bool
    host_timed_out: bool
    wall_s: float
    exec_id: str


@dataclass
class _Report:
    """The supervisor's last line."""

    exit: int
    signal: int
    wall: float
    cpu: float
    timed_out: bool
    output_exceeded: bool
    oom_kills: int
    pids_max: int
    vm_peak: int
    maxrss: int

    @classmethod
    def parse(cls, line: bytes, nonce: str) -> "_Report":
        """Raises ValueError unless the line carries this run's nonce."""
        kv = dict(item.split("=", 1) for item in line.decode("ascii", "replace").split())
        if kv.get("nonce") != nonce:
            raise ValueError("report without this run's nonce")
        return cls(exit=int(kv["exit"]), signal=int(kv["signal"]), wall=float(kv["wall"]),
                   cpu=float(kv["cpu"]), timed_out=kv["timed_out"] == "1",
                   output_exceeded=kv["output_exceeded"] == "1", oom_kills=int(kv["oom_kills"]),
                   pids_max=int(kv["pids_max"]), vm_peak=int(kv["vm_peak"]),
                   maxrss=int(kv["maxrss"]))


def _connect(base_url: str | None, timeout_s: float):
    try:
        import docker
    except ImportError as e:  # pragma: no cover - the SDK is a project dependency
        raise SandboxUnavailable(f"docker backend: the docker SDK is not importable ({e}); "
                                 f"pip install docker==7.2.0, or {_FIX}") from None
    where = base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        if base_url:
            client = docker.DockerClient(base_url=base_url, timeout=int(timeout_s))
        else:
            client = docker.from_env(timeout=int(timeout_s))
        client.ping()
    except Exception as e:  # DockerException, requests' ConnectionError, FileNotFoundError...
        raise SandboxUnavailable(f"docker backend: no Docker engine answers at {where} "
                                 f"({type(e).__name__}: {e}); {_FIX}") from None
    return client


def _owner_label() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(client=None, everything: bool = False) -> int:
    """Remove sandbox containers (found by label) whose owner process on this host is gone, or
    all of them with `everything=True`. Returns how many were removed."""
    client = client or _connect(None, 60)
    host = socket.gethostname()
    removed = 0
    for c in client.containers.list(all=True, filters={"label": LABEL}):
        owner_host, _, pid = c.labels.get("rlpost.owner", "").rpartition(":")
        stale = owner_host == host and pid.isdigit() and not _pid_alive(int(pid))
        if everything or stale:
            try:
                c.remove(force=True)
                removed += 1
            except Exception:
                pass
    return removed


def _remove_container(client, container_id: str) -> None:
    try:
        client.api.remove_container(container_id, force=True)
    except Exception:
        pass


class DockerBackend(Closing):
    """Runs boxes in one locked-down container (see the module doc for every setting).

    `base_url`: the engine (default: DOCKER_HOST or the local socket). `memory_mb` caps the
    container, i.e. all boxes of this backend together, tmpfs pages included (memory+swap is set
    to the same value: no swap); `tmpfs_mb` caps /tmp where the work dirs live; `pids_limit` caps
    the container's tasks; `cpus` optionally caps its CPU share; `user` is the container's own
    non-root user; `host_grace_s` is how long past a command's wall limit the host waits for the
    supervisor before killing the box's processes itself.
    Raises SandboxUnavailable when no engine answers, the image is missing, or the container
    cannot be set up. Boxes may be used from several threads at once (one box per thread).
    """

    name = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE, base_url: str | None = None, *,
                 memory_mb: int = 2048, tmpfs_mb: int = 512, pids_limit: int = 256,
                 cpus: float | None = None, user: str = "10001:10001",
                 api_timeout_s: float = 60.0, host_grace_s: float = 10.0) -> None:
        if user.split(":")[0] in ("0", "root", ""):
            raise ValueError("the sandbox container must run as a non-root user")
        import docker

        self.image = image
        self.host_grace_s = host_grace_s   # host-side deadline = wall_s + this
        self._client = _connect(base_url, api_timeout_s)
        self._api = self._client.api
        self._closed = False
        try:
            self._client.images.get(image)
        except docker.errors.ImageNotFound:
            self._client.close()
            raise SandboxUnavailable(
                f"docker backend: image {image} is not in the engine; build it with "
                f"sandbox/image/build_rootfs.sh (no registry needed) or `docker build -t {image} "
                f"sandbox/image`, or use sandbox.backend=process") from None
        remove_leftovers(self._client)

        t0 = time.monotonic()
        cname = f"rlpost-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self._container = self._client.containers.run(
                image, ["sleep", "infinity"], detach=True, init=True, user=user, name=cname,
                labels={LABEL: "1", "rlpost.owner": _owner_label()},
                network_mode="none", ipc_mode="private", hostname="sandbox",
                mem_limit=f"{memory_mb}m", memswap_limit=f"{memory_mb}m",
                pids_limit=pids_limit, read_only=True,
                tmpfs={"/tmp": f"rw,exec,nosuid,nodev,size={tmpfs_mb}m,mode=1777"},
                cap_drop=["ALL"], security_opt=["no-new-privileges"],
                environment={"PATH": PATH, "LANG": "C.UTF-8"}, working_dir="/tmp",
                nano_cpus=int(cpus * 1e9) if cpus else None)
        except docker.errors.DockerException as e:
            _remove_container(self._client, cname)   # created but failed to start
            self._client.close()
            raise SandboxUnavailable(f"docker backend: cannot start a container from {image} "
                                     f"({type(e).__name__}: {e}); {_FIX}") from None
        self._cid = self._container.id
        self._finalizer = weakref.finalize(self, _remove_container, self._client, self._cid)
        try:
            self._install_supervisor()
        except DockerSandboxError as e:
            self.close()
            raise SandboxUnavailable(f"docker backend: {e} (the image needs gcc)") from None
        self.start_s = time.monotonic() - t0   # container start + supervisor build

    @property
    def container_id(self) -> str:
        return self._cid

    def _install_supervisor(self) -> None:
        d = SUPERVISOR_DIR
        script = (f"umask 022 && mkdir -p {d} && cat > {d}/supervise.c && "
                  f"gcc -O2 -o {d}/supervise {d}/supervise.c && rm {d}/supervise.c")
        r = self._exec(["sh", "-c", script], user="", stdin=SUPERVISOR_C.encode(),
                       timeout_s=120.0)
        if r.exit_code != 0:
            raise DockerSandboxError(f"building the supervisor in the container failed (exit "
                                     f"{r.exit_code}): {r.stderr[-2000:].decode(errors='replace')}")

    def box(self) -> "DockerBox":
        if self._closed:
            raise DockerSandboxError("the docker backend is closed")
        return DockerBox(self)

    def close(self) -> None:
        """Remove the container (every box and process in it goes with it)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        try:
            self._client.close()
        except Exception:
            pass

    # ---- one docker exec -------------------------------------------------------------------

    def _exec(self, argv: list[str], *, user: str, workdir: str | None = None,
              stdin: bytes = b"", env: list[str] | None = None, out_cap: int = 1 << 20,
              err_cap: int = 1 << 20, timeout_s: float = 60.0, kill_on_timeout: bool = False,
              want_exit_code: bool = True) -> _Exec:
        """Run argv in the container, feeding stdin and collecting at most out_cap/err_cap bytes.
        On the host deadline the exec's uid is killed (kill_on_timeout) and the socket closed."""
        import docker

        t0 = time.monotonic()
        deadline = t0 + timeout_s
        try:
            ex = self._api.exec_create(self._cid, argv, stdin=True, stdout=True, stderr=True,
                                       user=user, workdir=workdir, environment=env)
            sock = self._api.exec_start(ex["Id"], socket=True)
        except docker.errors.DockerException as e:
            raise DockerSandboxError(f"docker exec failed ({type(e).__name__}: {e}); is the "
                                     f"sandbox container {self._cid[:12]} still running?") from None
        raw = getattr(sock, "_sock", sock)
        raw.settimeout(max(timeout_s, 1.0))
        writer = None

        def feed() -> None:
            try:
                if stdin:
                    raw.sendall(stdin)
                raw.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the command ended without reading all its input

        if len(stdin) <= 64 << 10:
            feed()   # fits in the socket buffer: no thread needed
        else:
            writer = threading.Thread(target=feed, name="docker-exec-stdin", daemon=True)
            writer.start()

        caps = {1: out_cap, 2: err_cap}
        bufs = {1: bytearray(), 2: bytearray()}
        over = {1: False, 2: False}
        seen = {1: 0, 2: 0}
        pending = bytearray()
        host_timed_out = False
        poller = _waiter(raw)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not poller(left):
                    host_timed_out = True
                    break
                try:
                    chunk = raw.recv(1 << 16)
                except (socket.timeout, BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                pending += chunk
                while len(pending) >= 8:
                    stream, size = pending[0], struct.unpack(">I", pending[4:8])[0]
                    if len(pending) < 8 + size:
                        break
                    if stream in bufs:
                        data = pending[8:8 + size]
                        seen[stream] += size
                        room = caps[stream] - len(bufs[stream])
                        if size > room:
                            over[stream] = True
                        if room > 0:
                            bufs[stream] += data[:room]
                    del pending[:8 + size]
                # Far over a cap: whatever should have stopped it did not; stop it here.
                if any(seen[s] > caps[s] + (1 << 20) for s in seen):
                    if kill_on_timeout:
                        self._kill_uid(user)
                    break
        finally:
            try:
                raw.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            raw.close()
            if writer is not None:
                writer.join(5)
        if host_timed_out and kill_on_timeout:
            self._kill_uid(user)
        exit_code = self._exit_code(ex["Id"]) if want_exit_code else None
        return _Exec(exit_code, bytes(bufs[1]), bytes(bufs[2]), over[1], over[2],
                     host_timed_out, time.monotonic() - t0, ex["Id"])

    def _exit_code(self, exec_id: str) -> int | None:
        """The exit status of a finished exec (None while it still runs or when unknown)."""
        try:
            return self._api.exec_inspect(exec_id).get("ExitCode")
        except Exception:
            return None

    def _kill_uid(self, user: str) -> None:
        try:
            self._exec([SUPERVISOR, "kill"], user=user, timeout_s=30.0)
        except DockerSandboxError:
            pass


def _waiter(sock):
    """A function `wait(seconds) -> bool` that tells whether sock became readable in time."""
    import select

    if hasattr(select, "poll"):
        p = select.poll()
        p.register(sock, select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR)
        return lambda left: bool(p.poll(max(1, int(left * 1000))))
    return lambda left: bool(select.select([sock], [], [], left)[0])  # pragma: no cover


class DockerBox(Closing):
    """One job's private work dir in the backend's container, with a uid of its own."""

    def __init__(self, backend: DockerBackend) -> None:
        self._backend = backend
        self.uid = _UID_LOW + secrets.randbelow(_UID_HIGH - _UID_LOW)
        self._user = f"{self.uid}:{self.uid}"
        self.dir = f"/tmp/job-{secrets.token_hex(8)}"
        self._env = [f"PATH={PATH}", f"HOME={self.dir}", f"TMPDIR={self.dir}", "LANG=C.UTF-8"]
        self._made = False     # the work dir is created by the first write (or run/read)
        self._closed = False

    def _ensure_dir(self) -> None:
        if not self._made:
            r = self._backend._exec(["mkdir", "-m", "700", "-p", "--", self.dir], user=self._user)
            if r.exit_code != 0:
                raise DockerSandboxError(f"cannot create {self.dir}: "
                                         f"{r.stderr.decode(errors='replace')}")
            self._made = True

    @staticmethod
    def _rel(name: str) -> str:
        parts = name.split("/")
        if not name or name.startswith("/") or "\0" in name or ".." in parts:
            raise ValueError(f"not a relative path inside the work dir: {name!r}")
        return name

    def _check_open(self) -> None:
        if self._closed:
            raise DockerSandboxError("the box is closed")

    def write(self, name: str, data: bytes, executable: bool = False) -> None:
        self._check_open()
        rel = self._rel(name)
        script = ('umask 077 && mkdir -p -- "$1" && cd -- "$1" && '
                  'case "$2" in */*) mkdir -p -- "${2%/*}";; esac && '
                  'cat > "$2" && chmod "$3" -- "$2"')
        r = self._backend._exec(
            ["sh", "-c", script, "sh", self.dir, rel, "700" if executable else "600"],
            user=self._user, stdin=bytes(data), timeout_s=120.0)
        if r.exit_code != 0:
            raise DockerSandboxError(f"writing {name} failed (exit {r.exit_code}): "
                                     f"{r.stderr[-1000:].decode(errors='replace')}")
        self._made = True

    def read(self, name: str, max_bytes: int = 1 << 20) -> bytes | None:
        self._check_open()
        rel = self._rel(name)
        self._ensure_dir()
        script = 'cd -- "$1" 2>/dev/null && [ -f "$2" ] || exit 3; exec head -c "$3" -- "$2"'
        r = self._backend._exec(["sh", "-c", script, "sh", self.dir, rel, str(int(max_bytes))],
                                user=self._user, workdir="/tmp", out_cap=max_bytes,
                                timeout_s=120.0)
        if r.exit_code == 3:
            return None
        if r.exit_code != 0:
            raise DockerSandboxError(f"reading {name} failed (exit {r.exit_code}): "
                                     f"{r.stderr[-1000:].decode(errors='replace')}")
        return r.stdout

    def run(self, argv: list[str], stdin: bytes = b"", limits: Limits = Limits()) -> ExecOutcome:
        self._check_open()
        if not argv or any("\0" in a for a in argv):
            raise ValueError(f"argv must be non-empty and free of NUL bytes: {argv!r}")
        self._ensure_dir()
        as_bytes = int(limits.memory_mb) << 20
        cmd = [SUPERVISOR, "run", self.dir, str(max(1, int(limits.wall_s * 1000))),
               str(max(1, math.ceil(limits.cpu_s))), str(as_bytes), str(int(limits.file_bytes)),
               str(int(limits.open_files)), str(int(limits.processes) + 1),
               str(int(limits.output_bytes)), "--", *argv]
        nonce = secrets.token_hex(16)
        r = self._backend._exec(cmd, user=self._user, workdir="/tmp",
                                stdin=nonce.encode() + b"\n" + bytes(stdin), env=self._env,
                                out_cap=limits.output_bytes, err_cap=limits.output_bytes + 4096,
                                timeout_s=limits.wall_s + self._backend.host_grace_s,
                                kill_on_timeout=True,
                                want_exit_code=False)
        cut = r.stderr.rfind(_REPORT_MARKER)
        rep = None
        if cut >= 0:
            try:
                rep = _Report.parse(r.stderr[cut + len(_REPORT_MARKER):], nonce)
            except (KeyError, ValueError):
                rep = None
        if rep is None:
            return self._without_report(r)
        stderr = r.stderr[:cut]
        abnormal = rep.signal != 0 or rep.exit != 0
        near_as = as_bytes > 0 and max(rep.vm_peak, rep.maxrss) >= 0.9 * as_bytes
        output_exceeded = rep.output_exceeded or r.stdout_over or len(stderr) > limits.output_bytes
        memory = abnormal and (rep.oom_kills > 0 or (near_as and not rep.timed_out
                                                      and not output_exceeded))
        return ExecOutcome(
            exit_code=None if rep.signal else rep.exit, signal=rep.signal or None,
            stdout=r.stdout, stderr=stderr[:limits.output_bytes], wall_s=rep.wall,
            cpu_s=rep.cpu, timed_out=rep.timed_out, memory_exceeded=memory,
            output_exceeded=output_exceeded, process_limit_hit=rep.pids_max > 0)

    def _without_report(self, r: _Exec) -> ExecOutcome:
        """No authentic report: the supervisor hung past the host deadline, or the command
        killed it (it runs as the same uid). Whatever is left of the command is killed."""
        if not r.host_timed_out:
            code = self._backend._exit_code(r.exec_id)
            self._backend._kill_uid(self._user)
            if code is not None and code < 128:   # not killed by a signal: it never ran right
                raise DockerSandboxError(f"the supervisor failed (exit {code}): "
                                         f"{r.stderr[-1000:].decode(errors='replace')}")
            why = f"docker: the command killed its supervisor (exit {code})"
        else:
            why = "docker: the supervisor did not finish in time"
        return ExecOutcome(exit_code=None, signal=9, stdout=r.stdout, stderr=r.stderr,
                           wall_s=r.wall_s, timed_out=r.host_timed_out, violation=why)

    def close(self) -> None:
        """Kill every process of the box's uid and remove its work dir (and anything else it
        left in /tmp or /dev/shm)."""
        if self._closed:
            return
        self._closed = True
        if self._backend._closed:
            return
        try:
            self._backend._exec([SUPERVISOR, "clean", self.dir], user=self._user, timeout_s=60.0)
        except DockerSandboxError:
            pass
