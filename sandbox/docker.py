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

Per command (`Box.run`), the supervisor (C, compiled with the container's gcc into
/tmp/.rlpost/supervise when the backend starts; source below) runs as the box uid:
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

import math
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass

from sandbox.backend import SandboxError, SandboxUnavailable
from sandbox.job import ExecOutcome, Limits

DEFAULT_IMAGE = "rlpost-sandbox:bookworm"
LABEL = "rlpost.sandbox"
SUPERVISOR_DIR = "/tmp/.rlpost"
SUPERVISOR = SUPERVISOR_DIR + "/supervise"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_REPORT_MARKER = b"\x1eRLPOST-SUPERVISE "
_UID_LOW, _UID_HIGH = 2_000_000, (1 << 31) - 2
_FIX = ("start an engine as root with sandbox/image/start_dockerd.sh (then build the image with "
        "sandbox/image/build_rootfs.sh), or use the bubblewrap backend: sandbox.backend=process")


class DockerSandboxError(SandboxError):
    """A sandbox operation failed for a reason outside the program (engine, container, I/O)."""


SUPERVISOR_C = r'''
/* rlpost sandbox supervisor: runs one command of a box under limits and reports how it ended.
 *
 *   supervise run DIR WALL_MS CPU_S AS_BYTES FSIZE_BYTES NOFILE NPROC OUT_BYTES -- ARGV...
 *   supervise kill          kill every other process of the calling uid
 *   supervise clean DIR     the same, then rm -rf DIR and whatever else the uid owns at the top
 *                           of /tmp and /dev/shm
 *
 * It runs as the box's own uid. `run` makes itself a child subreaper, starts ARGV in DIR in a new
 * session with rlimits (CPU soft < hard, AS, FSIZE, NOFILE, NPROC, CORE=0) and its stdout/stderr
 * on pipes, forwards at most OUT_BYTES of each, and kills every process of the uid
 * (kill(-1, SIGKILL)) when the command ends, times out or writes too much, so nothing outlives a
 * command. Then it reaps everything, and appends one report line to stderr after the marker
 * "\036RLPOST-SUPERVISE " (the last such marker in the stream is always its own: every other
 * process of the uid is dead when it writes it), carrying the nonce the host sent as the first
 * line of stdin, so a report forged by the command is never taken for its own.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* Processes (any state) whose real or effective uid is `uid`, other than ourselves, in this pid
 * namespace. Reads the Uid: line of /proc/PID/status (the owner of /proc/PID is root for a
 * process that made itself non-dumpable). */
static int count_others(uid_t uid) {
    DIR *d = opendir("/proc");
    struct dirent *e;
    char path[300], line[256];
    int n = 0;
    pid_t self = getpid();
    if (!d) return 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        if (atoi(e->d_name) == self) continue;
        snprintf(path, sizeof path, "/proc/%s/status", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        while (fgets(line, sizeof line, f)) {
            unsigned long r, eu;
            if (sscanf(line, "Uid: %lu %lu", &r, &eu) == 2) {
                if (r == uid || eu == uid) n++;
                break;
            }
        }
        fclose(f);
    }
    closedir(d);
    return n;
}

/* The command's main process: its status is kept when any reap below collects it. */
static pid_t main_pid = -1;
static int main_status = 0, main_done = 0;
static double main_end = 0;

static void reap_nohang(void) {
    int st;
    pid_t w;
    while ((w = waitpid(-1, &st, WNOHANG)) > 0)
        if (w == main_pid && !main_done) main_status = st, main_done = 1, main_end = now();
}

/* SIGKILL every process of our uid but us, reaping those that were ours, until none is left. */
static void kill_all(void) {
    uid_t uid = getuid();
    for (int i = 0; i < 500; i++) {
        kill(-1, SIGKILL);
        reap_nohang();
        if (count_others(uid) == 0) return;
        usleep(i < 10 ? 1000 : 10000);
    }
}

/* A "key N" counter from a cgroup file (memory.oom_control, memory.events, pids.events). */
static long long cg_counter(const char *const *paths, const char *key) {
    char line[256];
    size_t klen = strlen(key);
    for (; *paths; paths++) {
        FILE *f = fopen(*paths, "r");
        if (!f) continue;
        long long v = -1;
        while (fgets(line, sizeof line, f))
            if (strncmp(line, key, klen) == 0 && line[klen] == ' ') v = atoll(line + klen + 1);
        fclose(f);
        if (v >= 0) return v;
    }
    return -1;
}
static const char *const OOM_FILES[] = {"/sys/fs/cgroup/memory/memory.oom_control",
                                        "/sys/fs/cgroup/memory.events", NULL};
static const char *const PIDS_FILES[] = {"/sys/fs/cgroup/pids/pids.events",
                                         "/sys/fs/cgroup/pids.events", NULL};

static long long vm_peak(pid_t pid) {
    char path[64], line[256];
    long long kb = -1;
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmPeak:", 7) == 0) kb = atoll(line + 7);
    fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

static int write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void set_limit(int res, unsigned long long soft, unsigned long long hard) {
    struct rlimit r = {(rlim_t)soft, (rlim_t)hard};
    setrlimit(res, &r);
}

static int run(int argc, char **argv) {
    if (argc < 12 || strcmp(argv[10], "--") != 0) {
        fprintf(stderr, "supervise: bad arguments\n");
        return 125;
    }
    const char *dir = argv[2];
    double wall = atof(argv[3]) / 1000.0;
    unsigned long long cpu = strtoull(argv[4], NULL, 10), as = strtoull(argv[5], NULL, 10),
                       fsize = strtoull(argv[6], NULL, 10), nofile = strtoull(argv[7], NULL, 10),
                       nproc = strtoull(argv[8], NULL, 10), cap = strtoull(argv[9], NULL, 10);
    char **cmd = argv + 11;

    /* The command runs as our uid, so it could ptrace us or read our memory and fds: forbid that
     * (needs CAP_SYS_PTRACE once we are not dumpable). It can still kill us; then no report with
     * the nonce (the first line of stdin, unknown to the command) reaches the host. */
    prctl(PR_SET_DUMPABLE, 0);
    char nonce[80];
    size_t nlen = 0;
    for (;;) {
        char ch;
        ssize_t got = read(0, &ch, 1);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0 || ch == '\n') break;
        if (nlen + 1 < sizeof nonce) nonce[nlen++] = ch;
    }
    nonce[nlen] = 0;

    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC)) {
        perror("supervise: pipe");
        return 125;
    }
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    long long oom0 = cg_counter(OOM_FILES, "oom_kill"), pids0 = cg_counter(PIDS_FILES, "max");

    double t0 = now();
    pid_t pid = main_pid = fork();
    if (pid < 0) {
        perror("supervise: fork");
        return 125;
    }
    if (pid == 0) {
        setsid();
        dup2(out[1], 1);
        dup2(err[1], 2);
        signal(SIGPIPE, SIG_DFL);
        prctl(PR_SET_DUMPABLE, 1); /* (execve would too) so that /proc/self is ours again */
        /* Make the job, not the supervisor or the container's init, the OOM killer's choice. */
        int fd = open("/proc/self/oom_score_adj", O_WRONLY);
        if (fd >= 0) {
            (void)!write(fd, "1000", 4);
            close(fd);
        }
        if (cpu) set_limit(RLIMIT_CPU, cpu, cpu + 1);
        if (as) set_limit(RLIMIT_AS, as, as);
        if (fsize) set_limit(RLIMIT_FSIZE, fsize, fsize);
        if (nofile) set_limit(RLIMIT_NOFILE, nofile, nofile);
        if (nproc) set_limit(RLIMIT_NPROC, nproc, nproc);
        set_limit(RLIMIT_CORE, 0, 0);
        /* Entered here, not as the exec's cwd: a command that removed its own work dir makes
         * the later commands fail (exit 127), not the sandbox. */
        if (chdir(dir) != 0) {
            fprintf(stderr, "supervise: cannot enter the work dir %s: %s\n", dir, strerror(errno));
            _exit(127);
        }
        execvp(cmd[0], cmd);
        fprintf(stderr, "supervise: cannot run %s: %s\n", cmd[0], strerror(errno));
        _exit(127);
    }
    close(out[1]);
    close(err[1]);
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);

    struct pollfd fds[3];
    int open_fd[2] = {out[0], err[0]};
    unsigned long long sent[2] = {0, 0};
    int timed_out = 0, output_exceeded = 0;
    double deadline = t0 + wall;
    long long peak = -1;
    static char buf[65536];

    while (!main_done || open_fd[0] >= 0 || open_fd[1] >= 0) {
        int n = 0;
        for (int i = 0; i < 2; i++)
            if (open_fd[i] >= 0) fds[n++] = (struct pollfd){open_fd[i], POLLIN, 0};
        int pidx = -1;
        if (!main_done && pidfd >= 0) {
            pidx = n;
            fds[n++] = (struct pollfd){pidfd, POLLIN, 0};
        }
        double left = deadline - now();
        int ms = left <= 0 ? 0 : (int)(left * 1000) + 1;
        /* wake at least every 20 ms to sample VmPeak (and to poll the child without a pidfd) */
        if (!main_done && ms > 20) ms = 20;
        if (main_done && ms > 200) ms = 200;
        int r = poll(fds, n, ms);
        if (r < 0 && errno != EINTR) break;
        if (!main_done) {
            long long p = vm_peak(pid);
            if (p > peak) peak = p;
        }
        for (int i = 0; i < n && r > 0; i++) {
            if (i == pidx || !fds[i].revents) continue;
            int k = fds[i].fd == open_fd[0] ? 0 : 1;
            ssize_t got = read(fds[i].fd, buf, sizeof buf);
            if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            if (got <= 0) {
                close(open_fd[k]);
                open_fd[k] = -1;
                continue;
            }
            unsigned long long room = sent[k] < cap ? cap - sent[k] : 0;
            size_t fwd = (unsigned long long)got < room ? (size_t)got : (size_t)room;
            if (fwd) write_all(k + 1, buf, fwd);
            sent[k] += fwd;
            if ((unsigned long long)got > room && !output_exceeded) {
                output_exceeded = 1;
                kill_all();
            }
        }
        if (!main_done) {
            reap_nohang();
            if (main_done) {
                kill_all(); /* leftovers of the command would hold the pipes open */
                if (deadline > now() + 1.0) deadline = now() + 1.0;
            }
        }
        if (now() >= deadline && (!main_done || open_fd[0] >= 0 || open_fd[1] >= 0)) {
            if (!main_done) timed_out = 1;
            kill_all();
            if (main_done) { /* pipes still open although everything is dead: stop waiting */
                for (int k = 0; k < 2; k++)
                    if (open_fd[k] >= 0) close(open_fd[k]), open_fd[k] = -1;
            }
            deadline = now() + 1.0;
        }
    }
    kill_all();
    for (;;) {
        int st;
        pid_t w = waitpid(-1, &st, 0);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) break;
        if (w == main_pid && !main_done) main_status = st, main_done = 1, main_end = now();
    }
    int status = main_status;
    double end = main_end;
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    double cpu_used = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
                      ru.ru_stime.tv_usec / 1e6;
    long long oom1 = cg_counter(OOM_FILES, "oom_kill"), pids1 = cg_counter(PIDS_FILES, "max");
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (sig == SIGXCPU || (sig == SIGKILL && cpu && cpu_used >= (double)cpu)) timed_out = 1;
    if (sig == SIGXFSZ) output_exceeded = 1;
    fprintf(stderr,
            "\036RLPOST-SUPERVISE nonce=%s exit=%d signal=%d wall=%.6f cpu=%.6f timed_out=%d "
            "output_exceeded=%d oom_kills=%lld pids_max=%lld vm_peak=%lld maxrss=%lld\n",
            nonce, code, sig, end - t0, cpu_used, timed_out, output_exceeded,
            (oom0 >= 0 && oom1 >= 0) ? oom1 - oom0 : -1,
            (pids0 >= 0 && pids1 >= 0) ? pids1 - pids0 : -1, peak, (long long)ru.ru_maxrss * 1024);
    return 0;
}

/* argv for `rm -rf --` DIR plus every top-level entry of /tmp and /dev/shm that our uid owns
 * (files a command wrote outside its work dir). */
static char **clean_argv(const char *dir) {
    static const char *const roots[] = {"/tmp", "/dev/shm", NULL};
    size_t n = 0, cap = 64;
    char **v = malloc(cap * sizeof *v);
    v[n++] = "rm";
    v[n++] = "-rf";
    v[n++] = "--";
    v[n++] = (char *)dir;
    for (const char *const *r = roots; *r; r++) {
        DIR *d = opendir(*r);
        struct dirent *e;
        struct stat st;
        if (!d) continue;
        while ((e = readdir(d)) != NULL) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char *p;
            if (asprintf(&p, "%s/%s", *r, e->d_name) < 0) continue;
            if (lstat(p, &st) != 0 || st.st_uid != getuid() || !strcmp(p, dir)) {
                free(p);
                continue;
            }
            if (n + 2 >= cap) v = realloc(v, (cap *= 2) * sizeof *v);
            v[n++] = p;
        }
        closedir(d);
    }
    v[n] = NULL;
    return v;
}

int main(int argc, char **argv) {
    if (getuid() == 0 || geteuid() == 0) { /* kill(-1) as root would hit every process */
        fprintf(stderr, "supervise: refusing to run as root\n");
        return 126;
    }
    if (argc >= 2 && strcmp(argv[1], "run") == 0) return run(argc, argv);
    if (argc == 2 && strcmp(argv[1], "kill") == 0) {
        kill_all();
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "clean") == 0) {
        kill_all();
        char **v = clean_argv(argv[2]);
        execvp(v[0], v);
        perror("supervise: rm");
        return 1;
    }
    fprintf(stderr, "usage: supervise run DIR WALL_MS CPU_S AS FSIZE NOFILE NPROC OUT -- ARGV | "
                    "supervise kill | supervise clean DIR\n");
    return 2;
}
'''


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


class DockerBackend:
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

    def __enter__(self) -> "DockerBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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


class DockerBox:
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

    def __enter__(self) -> "DockerBox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
