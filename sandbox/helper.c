#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAGIC 0x726C7031u
#define MAX_FDS 8
#define MAX_RL 16
#define MAX_ARGS 4096
#define MSG_MAX 65536

struct hdr { uint32_t magic, nrl, argc, nfds; };
struct rl { uint32_t res, pad; uint64_t soft, hard; };
struct reply { int32_t kind, status; char msg[248]; };

/* ---- launcher ------------------------------------------------------------------------- */

static int err_fd = 2;

static void fail(const char *what, const char *arg) {
    dprintf(err_fd, "launcher: %s %s: %s\n", what, arg, strerror(errno));
    _exit(127);
}

static unsigned long long num(const char *s, char **end) {
    errno = 0;
    unsigned long long v = strtoull(s, end, 10);
    if (errno || *end == s) { errno = EINVAL; fail("bad number in", s); }
    return v;
}

static int launch(int argc, char **argv) {
    int i = 1;
    for (; i + 1 < argc && strcmp(argv[i], "--") != 0; i += 2) {
        const char *opt = argv[i], *val = argv[i + 1];
        char *end;
        if (!strcmp(opt, "-e")) {
            err_fd = (int)num(val, &end);
            if (fcntl(err_fd, F_SETFD, FD_CLOEXEC) < 0) fail("cannot use error fd", val);
        } else if (!strcmp(opt, "-j")) {
            int fd = open(val, O_WRONLY | O_CLOEXEC);
            if (fd < 0 || write(fd, "0", 1) != 1) fail("cannot join cgroup", val);
            close(fd);
        } else if (!strcmp(opt, "-u")) {
            unsigned long long id = num(val, &end);
            if (setgroups(0, NULL) < 0 || setresgid(id, id, id) < 0 || setresuid(id, id, id) < 0)
                fail("cannot switch to uid/gid", val);
        } else if (!strcmp(opt, "-r")) {
            struct rlimit rl;
            int res = (int)num(val, &end);
            if (*end != ':') { errno = EINVAL; fail("bad rlimit", val); }
            rl.rlim_cur = num(end + 1, &end);
            if (*end != ':') { errno = EINVAL; fail("bad rlimit", val); }
            rl.rlim_max = num(end + 1, &end);
            if (setrlimit(res, &rl) < 0) fail("cannot set rlimit", val);
        } else {
            errno = EINVAL;
            fail("unknown option", opt);
        }
    }
    if (i >= argc - 1 || strcmp(argv[i], "--") != 0) { errno = EINVAL; fail("usage:", argv[0]); }
    execvp(argv[i + 1], argv + i + 1);
    fail("cannot execute", argv[i + 1]);
    return 127;
}

/* ---- supervisor ----------------------------------------------------------------------- */

static int ctrl = -1;

static void reply(int kind, int status, const char *msg) {
    struct reply r;
    memset(&r, 0, sizeof r);
    r.kind = kind;
    r.status = status;
    snprintf(r.msg, sizeof r.msg, "%s", msg);
    if (send(ctrl, &r, sizeof r, MSG_NOSIGNAL) != (ssize_t)sizeof r) _exit(1);
}

/* Is the directory at `path` as the sandbox made it (empty, ours, mode 0755)? */
static int pristine(const char *path) {
    struct stat st;
    if (lstat(path, &st) < 0 || !S_ISDIR(st.st_mode) || (st.st_mode & 07777) != 0755
        || st.st_uid != getuid()) return 0;
    DIR *d = opendir(path);
    if (!d) return 0;
    struct dirent *e;
    int empty = 1;
    while (empty && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) empty = 0;
    closedir(d);
    return empty;
}

/* Reap until no child is left: the host kills everything the command left (it cannot leave
   its cgroups), so this ends. Then say so (reply 3), and whether the places a command can
   write besides the work dir are still as a fresh sandbox has them (status 1): if not, the
   host starts a fresh sandbox for the next command. */
static void reap_all(void) {
    while (waitpid(-1, NULL, 0) > 0 || errno == EINTR) {}
    reply(3, pristine("/tmp") && pristine("/dev/shm"), "");
}

static void child(char **argv, struct rl *rls, uint32_t nrl, int *fds, uint32_t nfds, int errw) {
    const char *step = "join cgroup";
    for (uint32_t i = 3; i < nfds; i++)
        if (write(fds[i], "0", 1) != 1) goto fail;
    step = "setsid";
    if (setsid() < 0) goto fail;
    step = "dup2";
    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], i) < 0) goto fail;
    step = "setrlimit";
    for (uint32_t i = 0; i < nrl; i++) {
        struct rlimit r = { rls[i].soft, rls[i].hard };
        if (setrlimit((int)rls[i].res, &r) < 0) goto fail;
    }
    step = "close fds";
    if (syscall(SYS_close_range, 3, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */) < 0) goto fail;
    execvp(argv[0], argv);
    dprintf(2, "%s: %s\n", argv[0], strerror(errno));
    _exit(errno == ENOENT ? 127 : 126);
fail:
    dprintf(errw, "cannot %s: %s", step, strerror(errno));
    _exit(126);
}

static int supervise(int argc, char **argv) {
    static char buf[MSG_MAX + 1];
    static char *args[MAX_ARGS + 1];
    if (argc != 4 || getpid() != 1) return 2;
    ctrl = atoi(argv[2]);
    close(atoi(argv[3]));                         /* our own binary */
    if (fcntl(ctrl, F_SETFD, FD_CLOEXEC) < 0 || prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0
        || prctl(PR_SET_NAME, "rlpost-box", 0, 0, 0) < 0) return 2;
    sigset_t none;                                /* commands start with default signals */
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int sig = 1; sig < NSIG; sig++) signal(sig, SIG_DFL);
    for (;;) {
        char cbuf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        struct iovec iov = { buf, MSG_MAX };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1,
                             .msg_control = cbuf, .msg_controllen = sizeof cbuf };
        ssize_t n = recvmsg(ctrl, &mh, MSG_CMSG_CLOEXEC);
        if (n == 0) return 0;                     /* the host closed the box */
        if (n < 0) { if (errno == EINTR) continue; return 1; }
        int fds[MAX_FDS];
        uint32_t nfds = 0;
        const char *bad = NULL;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
                for (size_t k = 0; k < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); k++) {
                    int fd;
                    memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
                    if (nfds < MAX_FDS && fd > 2) fds[nfds++] = fd;
                    else { close(fd); bad = "bad message"; }
                }
        struct hdr h = { 0, 0, 0, 0 };
        size_t off = 0;
        if ((size_t)n < sizeof h || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) bad = "bad message";
        else {
            memcpy(&h, buf, sizeof h);
            off = sizeof h + (size_t)h.nrl * sizeof(struct rl);
            if (h.magic != MAGIC || h.nrl > MAX_RL || h.argc < 1 || h.argc > MAX_ARGS
                || h.nfds != nfds || nfds < 3 || off > (size_t)n) bad = "bad message";
        }
        buf[n] = 0;
        for (uint32_t i = 0; !bad && i < h.argc; i++) {
            if (off >= (size_t)n) { bad = "bad message"; break; }
            args[i] = buf + off;
            off += strlen(buf + off) + 1;
        }
        if (!bad) args[h.argc] = NULL;
        int ep[2] = { -1, -1 };
        pid_t pid = -1;
        if (!bad && pipe2(ep, O_CLOEXEC) < 0) bad = "pipe failed";
        if (!bad && (pid = fork()) < 0) bad = "fork failed";
        if (pid == 0) {
            static struct rl rls[MAX_RL];
            memcpy(rls, buf + sizeof h, h.nrl * sizeof(struct rl));
            child(args, rls, h.nrl, fds, nfds, ep[1]);
        }
        for (uint32_t i = 0; i < nfds; i++) close(fds[i]);
        if (ep[1] >= 0) close(ep[1]);
        if (bad) { if (ep[0] >= 0) close(ep[0]); reply(2, 0, bad); reap_all(); continue; }
        char err[200] = "";
        ssize_t m;
        while ((m = read(ep[0], err, sizeof err - 1)) < 0 && errno == EINTR) {}
        close(ep[0]);
        int st = 0;
        if (m > 0) {
            err[m] = 0;
            reply(2, 0, err);
            reap_all();
            continue;
        }
        for (;;) {                                /* reap orphans until the command ends */
            pid_t w = waitpid(-1, &st, 0);
            if (w == pid) break;
            if (w < 0 && errno != EINTR) { reply(2, 0, "lost the command"); return 1; }
        }
        reply(1, st, "");
        reap_all();
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "supervise")) return supervise(argc, argv);
    return launch(argc, argv);
}
