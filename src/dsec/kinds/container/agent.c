/*
 * dsec-agent: pid 1 of a container sandbox, and the executor of its commands.
 *
 * crun starts it as the container's init, so it runs with exactly the sandbox's namespaces, cgroup,
 * capabilities, no_new_privs and seccomp filter: it is inside the boundary, not part of it. Being
 * the namespace's init, it cannot be killed from inside (the kernel drops signals to an init that has
 * no handler for them) and, being non-dumpable, it cannot be read or written through /proc by the
 * workload; ptrace is refused by seccomp. Its binary lives on a read-only mount.
 *
 * Protocol on fd 3 (a stream socket whose other end the daemon holds); all integers little endian.
 *   daemon -> agent: u32 len | 'E' u32 id u32 argc u32 envc | cwd\0 argv...\0 env...\0
 *                    with SCM_RIGHTS [stdin, stdout, stderr, cgroup.procs of the exec's cgroup]
 *                    u32 len | 'U' u32 id u32 argc u32 envc u32 uid u32 gid | (as 'E')
 *                    the same, run as uid:gid (the image's runtime account) instead of root
 *                    u32 len | 'T' u32 id u32 argc u32 envc u32 uid u32 gid u32 rows u32 cols | (as 'E')
 *                    with SCM_RIGHTS [cgroup.procs]: the command runs on a new pseudo-terminal of
 *                    rows x cols (uid:gid 0:0 is root), which is its controlling terminal and stdio
 *                    u32 len | 'H' u32 0          (hello from a daemon that re-attached)
 *   agent -> daemon: u32 len | type u32 id i64 value
 *                    'R' ready (value = 0), 'S' started (value = pid in the sandbox),
 *                    'F' fork failed (value = errno), 'X' exited (value = raw wait status),
 *                    'M' the terminal's master (value = 0) with SCM_RIGHTS [master], before its 'S'
 * The child moves itself into the exec's cgroup (through the daemon-opened cgroup.procs fd) before it
 * runs anything, so a timeout's cgroup.kill reaches every process the command starts.
 *
 * A terminal is made here, in the sandbox's own devpts (/dev/ptmx), so that the command sees a
 * terminal of its sandbox (tty, ttyname, its owner); the daemon gets the master and checks that it
 * is one before it reads or writes it.
 *
 * When the daemon goes away (EOF), the agent keeps reaping and parks a fresh socketpair end on fd 4;
 * a restarted daemon takes it with pidfd_getfd(2) and says hello.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <termios.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define CTRL_FD 3
#define RENDEZVOUS_FD 4
#define MAX_FRAME (8u << 20)
#define MAX_TRACKED 8192

extern char **environ;

static int ctrl = CTRL_FD;
static int parked = 0;
static pid_t tracked_pid[MAX_TRACKED];
static uint32_t tracked_id[MAX_TRACKED];

static int write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int read_all(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n == 0) return -1;
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void reply(char type, uint32_t id, int64_t value) {
    unsigned char buf[4 + 1 + 4 + 8];
    uint32_t len = 13;
    memcpy(buf, &len, 4);
    buf[4] = (unsigned char)type;
    memcpy(buf + 5, &id, 4);
    memcpy(buf + 9, &value, 8);
    (void)write_all(ctrl, buf, sizeof buf); /* a lost daemon is noticed on the read side */
}

/* A reply that carries one descriptor (the daemon takes it with the frame's first byte). */
static void reply_fd(char type, uint32_t id, int fd) {
    unsigned char buf[4 + 1 + 4 + 8];
    uint32_t len = 13;
    int64_t value = 0;
    memcpy(buf, &len, 4);
    buf[4] = (unsigned char)type;
    memcpy(buf + 5, &id, 4);
    memcpy(buf + 9, &value, 8);
    union {
        char raw[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cbuf;
    memset(&cbuf, 0, sizeof cbuf);
    struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.raw, .msg_controllen = sizeof cbuf.raw};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    ssize_t n;
    do n = sendmsg(ctrl, &msg, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n > 0 && (size_t)n < sizeof buf) (void)write_all(ctrl, buf + n, sizeof buf - (size_t)n);
}

/* A new pseudo-terminal of the sandbox's devpts, unlocked and sized: returns the master and puts
 * the slave (opened from the master, no path involved) in *slave; -1 with errno on failure. */
static int open_terminal(uint32_t rows, uint32_t cols, int as_user, uint32_t uid, int *slave) {
    int master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
    if (master < 0) return -1;
    int unlock = 0;
    struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
    if (ioctl(master, TIOCSPTLCK, &unlock) < 0 || ioctl(master, TIOCSWINSZ, &ws) < 0 ||
        (*slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
        int err = errno;
        close(master);
        errno = err;
        return -1;
    }
    /* the terminal belongs to the account that uses it, as login(1) does it (programs reopen it) */
    if (as_user) (void)!fchown(*slave, uid, (gid_t)-1);
    return master;
}

static void track(pid_t pid, uint32_t id) {
    for (int i = 0; i < MAX_TRACKED; i++) {
        if (tracked_pid[i] == 0) {
            tracked_pid[i] = pid;
            tracked_id[i] = id;
            return;
        }
    }
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_TRACKED; i++) {
            if (tracked_pid[i] == pid) {
                tracked_pid[i] = 0;
                reply('X', tracked_id[i], status);
                break;
            }
        }
        /* anything else is an orphan the agent reaps as init */
    }
}

static void park(void) {
    int sv[2];
    close(ctrl);
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) _exit(1);
    /* our end goes well above fd 4; the parked end goes exactly to fd 4 (it may already be there) */
    int keep = fcntl(sv[0], F_DUPFD_CLOEXEC, 17);
    if (keep < 0) _exit(1);
    close(sv[0]);
    if (sv[1] != RENDEZVOUS_FD) {
        if (dup2(sv[1], RENDEZVOUS_FD) < 0) _exit(1);
        close(sv[1]);
    }
    ctrl = keep;
    parked = 1;
}

/* stdio: [stdin, stdout, stderr, cgroup.procs]; terminal: stdin is a terminal to make the controlling one */
static void child(const char *cwd, char **argv, char **envp, int stdio[4], int terminal, int joined, int as_user,
                  uint32_t uid, uint32_t gid) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    setsid();
    int in_group = write(stdio[3], "0", 1) == 1;
    int join_err = errno;
    close(joined); /* the agent reports the start only now (see serve_one) */
    if (!in_group) {
        dprintf(stdio[2], "dsec: cannot enter the exec's cgroup: %s\n", strerror(join_err));
        _exit(125);
    }
    if (terminal && ioctl(stdio[0], TIOCSCTTY, 0) < 0) {
        dprintf(stdio[2], "dsec: cannot take the terminal: %s\n", strerror(errno));
        _exit(125);
    }
    if (dup2(stdio[0], 0) < 0 || dup2(stdio[1], 1) < 0 || dup2(stdio[2], 2) < 0) _exit(125);
    if (as_user && (setgroups(0, NULL) < 0 || setgid(gid) < 0 || setuid(uid) < 0)) {
        dprintf(2, "dsec: cannot switch to user %u:%u: %s\n", uid, gid, strerror(errno));
        _exit(125);
    }
    close_range(3, ~0U, 0);
    if (cwd[0] && chdir(cwd) < 0) {
        dprintf(2, "dsec: cannot change directory to %s: %s\n", cwd, strerror(errno));
        _exit(126);
    }
    environ = envp;
    execvp(argv[0], argv);
    int err = errno;
    dprintf(2, "dsec: cannot run %s: %s\n", argv[0], strerror(err));
    _exit(err == ENOENT ? 127 : 126);
}

static void close_fds(int *fds, int n) {
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0) close(fds[i]);
}

/* Forks the command and reports it: 'M' with the terminal's master first when there is one, then
 * 'S' (or 'F'). */
static void start_command(uint32_t id, const char *cwd, char **argv, char **envp, int stdio[4], int master,
                          int as_user, uint32_t uid, uint32_t gid) {
    /* 'S' goes out only once the child is in the exec's cgroup: a signal sent to the group as soon
     * as the daemon knows the pid (a kill right after the start) must reach the command. The
     * child closes its end of this pipe when it has joined (or died trying). */
    int joined[2];
    pid_t pid = -1;
    if (pipe2(joined, O_CLOEXEC) == 0) {
        pid = fork();
        if (pid == 0) {
            close(joined[0]);
            child(cwd, argv, envp, stdio, master >= 0, joined[1], as_user, uid, gid);
        }
        int err = errno;
        close(joined[1]);
        if (pid > 0) {
            char c;
            while (read(joined[0], &c, 1) < 0 && errno == EINTR) {
            }
        }
        close(joined[0]);
        errno = err;
    }
    if (pid < 0) {
        reply('F', id, errno);
        return;
    }
    track(pid, id);
    if (master >= 0) reply_fd('M', id, master);
    reply('S', id, pid);
}

/* Returns -1 when the control channel is gone. */
static int serve_one(void) {
    uint32_t len;
    int fds[4] = {-1, -1, -1, -1};
    int nfds = 0;
    char cbuf[CMSG_SPACE(sizeof(int) * 4)];
    struct iovec iov = {.iov_base = &len, .iov_len = sizeof len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    ssize_t n;
    do n = recvmsg(ctrl, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    while (n < 0 && errno == EINTR);
    if (n <= 0) return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < count; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                if (nfds < 4) fds[nfds++] = fd;
                else close(fd);
            }
        }
    }
    if (n != sizeof len || len < 5 || len > MAX_FRAME) {
        close_fds(fds, nfds);
        return -1;
    }
    char *body = malloc(len + 1);
    if (!body || read_all(ctrl, body, len) < 0) {
        free(body);
        close_fds(fds, nfds);
        return -1;
    }
    body[len] = 0;
    if (parked) { /* a daemon took the parked end: it alone holds the peer now */
        close(RENDEZVOUS_FD);
        parked = 0;
    }
    uint32_t id;
    memcpy(&id, body + 1, 4);
    char type = body[0];
    int terminal = type == 'T', as_user = type == 'U' || terminal;
    uint32_t head = terminal ? 29u : as_user ? 21u : 13u;
    if ((type != 'E' && !as_user) || len < head + 4 || nfds != (terminal ? 1 : 4)) {
        if (type == 'H') reply('R', 0, 0);
        close_fds(fds, nfds);
        free(body);
        return 0;
    }
    uint32_t argc, envc, uid = 0, gid = 0, size[2] = {0, 0};
    memcpy(&argc, body + 5, 4);
    memcpy(&envc, body + 9, 4);
    if (as_user) {
        memcpy(&uid, body + 13, 4);
        memcpy(&gid, body + 17, 4);
    }
    if (terminal) {
        memcpy(size, body + 21, 8);
        as_user = uid != 0 || gid != 0;
    }
    /* then the strings: cwd, then argc argv strings, then envc env strings */
    char **argv = calloc((size_t)argc + 1, sizeof(char *));
    char **envp = calloc((size_t)envc + 1, sizeof(char *));
    char *p = body + head, *end = body + len;
    char *cwd = p;
    int ok = argv && envp && argc > 0 && argc < (1u << 20) && envc < (1u << 20);
    p += strnlen(p, (size_t)(end - p)) + 1;
    for (uint32_t i = 0; ok && i < argc; i++) {
        if (p >= end) ok = 0;
        else { argv[i] = p; p += strnlen(p, (size_t)(end - p)) + 1; }
    }
    for (uint32_t i = 0; ok && i < envc; i++) {
        if (p >= end) ok = 0;
        else { envp[i] = p; p += strnlen(p, (size_t)(end - p)) + 1; }
    }
    if (!ok) reply('F', id, EINVAL);
    else if (!terminal) start_command(id, cwd, argv, envp, fds, -1, as_user, uid, gid);
    else {
        int slave = -1, master = open_terminal(size[0], size[1], as_user, uid, &slave);
        if (master < 0) reply('F', id, errno);
        else {
            int stdio[4] = {slave, slave, slave, fds[0]};
            start_command(id, cwd, argv, envp, stdio, master, as_user, uid, gid);
            close(slave);
            close(master); /* the daemon holds it now: the terminal lives as long as its copy */
        }
    }
    close_fds(fds, nfds);
    free(argv);
    free(envp);
    free(body);
    return 0;
}

/* `agent --userns`: a placeholder process for a fresh user namespace. The daemon writes its id maps,
 * opens /proc/PID/ns/user to idmap the sandbox's image layers, then closes our stdin. */
static int userns_helper(void) {
    char c;
    if (unshare(CLONE_NEWUSER) < 0) return 1;
    if (write(1, "\n", 1) != 1) return 1;
    while (read(0, &c, 1) > 0) {
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--userns") == 0) return userns_helper();
    prctl(PR_SET_DUMPABLE, 0);
    signal(SIGPIPE, SIG_IGN);
    if (fcntl(CTRL_FD, F_SETFD, FD_CLOEXEC) < 0) {
        /* started without a daemon channel: nothing to serve, but stay a reaping init */
        park();
    }
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) return 1;
    /* keep low numbers free: fd 4 is where a daemon-less agent parks its rendezvous socket */
    int high = fcntl(sfd, F_DUPFD_CLOEXEC, 16);
    if (high < 0) return 1;
    close(sfd);
    sfd = high;
    if (!parked) reply('R', 0, 0);
    for (;;) {
        struct pollfd pfd[2] = {{.fd = ctrl, .events = POLLIN}, {.fd = sfd, .events = POLLIN}};
        if (poll(pfd, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        if (pfd[1].revents & POLLNVAL) return 1; /* cannot happen; never spin if it does */
        if (pfd[1].revents & POLLIN) {
            struct signalfd_siginfo info;
            while (read(sfd, &info, sizeof info) > 0) {
            }
            reap();
        }
        if (pfd[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            if (serve_one() < 0) park();
        }
    }
}
