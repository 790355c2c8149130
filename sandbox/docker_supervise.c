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
