/*
 * dsec guest agent: pid 1 of a microvm/vm sandbox's root filesystem, and the executor of its commands.
 *
 * The initramfs execs it after switch_root, from a read-only device mounted at /.dsec. It talks to the
 * daemon over the virtio-serial port named "dsec.agent" (QEMU turns the host side into a unix socket).
 * No fds can cross that port, so a command's output travels as frames and the agent owns its pipes.
 *
 * Frames, both ways, all integers little endian:  u32 len | u8 type | u32 id | payload  (len = 5 + payload)
 *   host -> agent  'E' exec      u32 argc u32 envc u32 flags u32 uid u32 gid | cwd\0 argv...\0 env...\0
 *                                flags bit 0: stdin follows as 'I' frames (else stdin is /dev/null)
 *                  'I' stdin     bytes; an empty payload closes the command's stdin
 *                  'K' kill      u32 signal, for the exec's whole tree (its cgroup, else its process group)
 *                  'P' ping      any payload, echoed back as 'p'
 *                  'H' hello     re-announce: a VM restored from a memory snapshot may still believe it
 *                                talks to the host it was saved with; answered with a fresh 'R'
 *                  'T' refresh   i64 sec i64 nsec | entropy bytes: after a memory-snapshot restore, set the
 *                                clock and reseed the kernel's CRNG (VMs restored from one snapshot must not
 *                                share random output); answered 't' with u8 clock_ok u8 rng_ok
 *   agent -> host  'R' ready     id 0, the agent's version; first frame of every connection
 *                  'S' started   i64 pid          'F' not started   u32 errno | message
 *                  'O' stdout    'e' stderr       chunks of at most 64 KiB
 *                  'X' exited    i32 raw wait status; after all of the exec's 'O'/'e'
 * A frame over 8 MiB, or shorter than 5, is a protocol error: the agent forgets the connection's state
 * and ignores the port until the host hangs up (with --fd it exits).
 *
 * The host must not send before it has seen 'R': whatever the port holds before the agent announces
 * itself is left over from an earlier connection and is discarded. While no host is connected, output
 * of running commands is dropped (they keep running); their exit statuses are kept (bounded) and sent
 * after the next 'R'.
 *
 * `agent --fd N [--cgroup-root DIR]` serves an already-open fd instead (tests): no mounts, process
 * groups unless DIR is a writable cgroup2 directory, and EOF on N means "exit".
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/random.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire format is little endian and frames are copied as native integers"
#endif

#define AGENT_VERSION "dsec-guest-agent/1"
#define PORT_NAME "dsec.agent"
#define PORTS_DIR "/sys/class/virtio-ports"
#define HDR 9u
#define MAX_FRAME (8u << 20)
#define CHUNK 65536u
#define MAX_EXECS 1024
#define MAX_EXITS 4096
#define MAX_STALE 1024
#define OUT_HIGH (1u << 20)     /* queued output above which the commands' pipes are left unread */
#define STDIN_CAP (64u << 20)   /* stdin buffered for one command that does not read it */
#define FINAL_DRAIN (1u << 20)  /* per stream, once the grace after a command's exit is over */
#define GRACE_MS 200
#define RETRY_MS 100
#define CG_RETRY_MS 1000
#define CGROUP2_MAGIC 0x63677270

extern char **environ;

struct buf {
    char *data;
    size_t off, len, cap;
};

struct exec {
    int used;
    uint32_t id;
    pid_t pid;  /* 0 once reaped */
    pid_t pgid; /* kept after the reap: background members may still run */
    int in_fd, out_fd, err_fd;
    struct buf in;
    int in_eof;
    int reaped, status;
    int64_t reaped_at;
};

struct exit_rec {
    uint32_t id;
    int32_t status;
    uint64_t queued_end; /* enq_total after its 'X' was queued; 0: not queued on this connection */
};

enum port_state { PORT_CLOSED, PORT_WAITING, PORT_CONNECTED, PORT_DESYNC };

static int fd_mode, port = -1, sfd = -1;
static enum port_state state = PORT_CLOSED;
static int64_t next_retry, next_cg_retry;
static const char *cg_root;
static struct buf inq, outq;
static uint64_t enq_total, sent_total;
static struct exec execs[MAX_EXECS];
static int nexecs;
static struct exit_rec exits[MAX_EXITS];
static int nexits;
static uint32_t stale[MAX_STALE];
static int nstale;
static char scratch[CHUNK];

static void logmsg(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    dprintf(2, "dsec-agent: ");
    vdprintf(2, fmt, ap);
    dprintf(2, "\n");
    va_end(ap);
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* ---- buffers and frames -------------------------------------------------------------------------- */

static size_t buf_used(const struct buf *b) { return b->len - b->off; }

static int buf_reserve(struct buf *b, size_t extra) {
    if (b->off > 0 && (b->off == b->len || b->len + extra > b->cap)) {
        memmove(b->data, b->data + b->off, b->len - b->off);
        b->len -= b->off;
        b->off = 0;
    }
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : CHUNK * 2;
    while (cap < b->len + extra) cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) return -1;
    b->data = p;
    b->cap = cap;
    return 0;
}

static void buf_consumed(struct buf *b, size_t n) {
    b->off += n;
    if (b->off == b->len) {
        b->off = b->len = 0;
        if (b->cap > 4 * OUT_HIGH) { /* give a burst's memory back */
            free(b->data);
            b->data = NULL;
            b->cap = 0;
        }
    }
}

static void buf_free(struct buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

/* Room for one frame of up to max payload bytes in the output queue, or NULL (not connected, no memory). */
static char *frame_start(size_t max) {
    if (state != PORT_CONNECTED || buf_reserve(&outq, HDR + max) < 0) return NULL;
    return outq.data + outq.len + HDR;
}

static void frame_commit(char type, uint32_t id, size_t n) {
    uint32_t len = (uint32_t)(5 + n);
    char *h = outq.data + outq.len;
    memcpy(h, &len, 4);
    h[4] = type;
    memcpy(h + 5, &id, 4);
    outq.len += HDR + n;
    enq_total += HDR + n;
}

static int send_frame(char type, uint32_t id, const void *payload, size_t n) {
    char *dst = frame_start(n);
    if (!dst) return -1;
    if (n) memcpy(dst, payload, n);
    frame_commit(type, id, n);
    return 0;
}

static void send_failure(uint32_t id, int err, const char *fmt, ...) {
    char msg[600];
    uint32_t e = (uint32_t)err;
    memcpy(msg, &e, 4);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg + 4, sizeof msg - 4, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    if ((size_t)n > sizeof msg - 5) n = (int)sizeof msg - 5;
    send_frame('F', id, msg, 4 + (size_t)n);
}

/* ---- exit statuses that must reach a host ------------------------------------------------------- */

static void prune_exits(void) {
    int j = 0;
    for (int i = 0; i < nexits; i++)
        if (!(exits[i].queued_end && exits[i].queued_end <= sent_total)) exits[j++] = exits[i];
    nexits = j;
}

static void queue_exit(struct exit_rec *r) {
    if (send_frame('X', r->id, &r->status, 4) == 0) r->queued_end = enq_total;
}

static void report_exit(uint32_t id, int status) {
    if (nexits == MAX_EXITS) { /* nobody has listened for a long time: forget the oldest */
        logmsg("too many undelivered exit statuses; dropping exec %u's", exits[0].id);
        memmove(exits, exits + 1, sizeof exits[0] * (MAX_EXITS - 1));
        nexits--;
    }
    struct exit_rec *r = &exits[nexits++];
    r->id = id;
    r->status = status;
    r->queued_end = 0;
    queue_exit(r);
}

/* ---- cgroups ------------------------------------------------------------------------------------- */

static int group_path(char *out, size_t size, uint32_t id, const char *file) {
    int n = snprintf(out, size, "%s/exec-%u%s%s", cg_root, id, file ? "/" : "", file ? file : "");
    return n > 0 && (size_t)n < size ? 0 : -1;
}

/* Returns 0 when the group is gone. */
static int rmdir_group(uint32_t id) {
    char path[4096];
    if (!cg_root || group_path(path, sizeof path, id, NULL) < 0) return 0;
    return rmdir(path) == 0 || errno == ENOENT ? 0 : -1;
}

static void remove_group(uint32_t id) {
    if (rmdir_group(id) == 0) return;
    /* background processes still live in it: try again later */
    if (nstale == MAX_STALE) {
        memmove(stale, stale + 1, sizeof stale[0] * (MAX_STALE - 1));
        nstale--;
    }
    stale[nstale++] = id;
    if (nstale == 1) next_cg_retry = now_ms() + CG_RETRY_MS;
}

static void retry_groups(void) {
    int j = 0;
    for (int i = 0; i < nstale; i++)
        if (rmdir_group(stale[i]) != 0) stale[j++] = stale[i];
    nstale = j;
    next_cg_retry = now_ms() + CG_RETRY_MS;
}

static void setup_cgroups(const char *dir) {
    struct statfs sf;
    if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
        logmsg("no exec cgroups (mkdir %s: %s); killing process groups instead", dir, strerror(errno));
        return;
    }
    if (statfs(dir, &sf) < 0 || sf.f_type != CGROUP2_MAGIC || access(dir, W_OK) < 0) {
        logmsg("no exec cgroups (%s is not a writable cgroup2 directory); killing process groups instead", dir);
        return;
    }
    cg_root = dir;
}

/* ---- commands ------------------------------------------------------------------------------------ */

static struct exec *find_exec(uint32_t id) {
    for (int i = 0, seen = 0; i < MAX_EXECS && seen < nexecs; i++) {
        if (!execs[i].used) continue;
        seen++;
        if (execs[i].id == id) return &execs[i];
    }
    return NULL;
}

static void kill_tree(struct exec *x, uint32_t id, int sig) {
    /* Both on SIGKILL: the cgroup catches processes that left the process group (setsid), and the
     * process group covers a command that could not join its cgroup (or a kernel without cgroup.kill). */
    char path[4096];
    int fd;
    if (sig == SIGKILL && cg_root && group_path(path, sizeof path, id, "cgroup.kill") == 0 &&
        (fd = open(path, O_WRONLY | O_CLOEXEC)) >= 0) {
        (void)!write(fd, "1", 1);
        close(fd);
    }
    if (x && x->pgid > 0) kill(-x->pgid, sig);
}

static void finish(struct exec *x) {
    report_exit(x->id, x->status);
    close_fd(&x->in_fd);
    close_fd(&x->out_fd);
    close_fd(&x->err_fd);
    buf_free(&x->in);
    if (cg_root) remove_group(x->id);
    memset(x, 0, sizeof *x);
    nexecs--;
}

static void maybe_finish(struct exec *x) {
    if (x->reaped && x->out_fd < 0 && x->err_fd < 0) finish(x);
}

/* Forward what a command's stdout/stderr holds, up to budget bytes; closes the fd at EOF. */
static void pump(struct exec *x, int *fd, char type, size_t budget) {
    size_t done = 0;
    while (*fd >= 0 && done < budget) {
        /* backpressure: a slow host makes the command block on its pipe, never the agent */
        if (budget == CHUNK && state == PORT_CONNECTED && buf_used(&outq) >= OUT_HIGH) return;
        char *dst = frame_start(CHUNK);
        ssize_t n = read(*fd, dst ? dst : scratch, CHUNK);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN) close_fd(fd);
            return;
        }
        if (n == 0) {
            close_fd(fd);
            return;
        }
        if (dst) frame_commit(type, x->id, (size_t)n);
        done += (size_t)n;
    }
}

static void write_stdin(struct exec *x) {
    while (buf_used(&x->in)) {
        ssize_t n = write(x->in_fd, x->in.data + x->in.off, buf_used(&x->in));
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;
            break; /* EPIPE: the command closed its stdin */
        }
        buf_consumed(&x->in, (size_t)n);
    }
    if (!buf_used(&x->in) && !x->in_eof) return;
    close_fd(&x->in_fd);
    buf_free(&x->in);
}

static void stdin_data(uint32_t id, const char *p, size_t n) {
    struct exec *x = find_exec(id);
    if (!x || x->in_fd < 0) return; /* no stdin pipe, or the command is gone */
    if (n == 0) {
        x->in_eof = 1;
    } else if (buf_used(&x->in) + n > STDIN_CAP || buf_reserve(&x->in, n) < 0) {
        const char note[] = "dsec: the command does not read its stdin; the rest of it was dropped\n";
        send_frame('e', id, note, sizeof note - 1);
        x->in_eof = 1;
        buf_free(&x->in);
    } else {
        memcpy(x->in.data + x->in.len, p, n);
        x->in.len += n;
    }
    write_stdin(x);
}

static void child(const char *procs, int in_fd, int out_fd, int err_fd, uint32_t uid, uint32_t gid, const char *cwd,
                  char **argv, char **envp) {
    for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL); /* ignored dispositions would survive exec */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setsid();
    if (procs) { /* best effort: without it the process group still reaches the tree */
        int fd = open(procs, O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            (void)!write(fd, "0", 1);
            close(fd);
        }
    }
    if (in_fd < 0) in_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    /* the agent keeps fds 0-2 occupied, so none of these is already its target */
    if (in_fd < 0 || dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0) _exit(125);
    if ((uid || gid) && (setgroups(0, NULL) < 0 || setgid(gid) < 0 || setuid(uid) < 0)) {
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

/* Next NUL-terminated string at *p before end, or NULL. */
static char *next_str(char **p, char *end) {
    char *s = *p;
    if (s >= end) return NULL;
    size_t n = strnlen(s, (size_t)(end - s));
    if (n == (size_t)(end - s)) return NULL;
    *p = s + n + 1;
    return s;
}

static void start_exec(uint32_t id, char *p, size_t n) {
    uint32_t hdr[5];
    if (n < sizeof hdr) {
        send_failure(id, EINVAL, "malformed exec request");
        return;
    }
    memcpy(hdr, p, sizeof hdr);
    uint32_t argc = hdr[0], envc = hdr[1], flags = hdr[2], uid = hdr[3], gid = hdr[4];
    if (argc == 0 || (uint64_t)argc + envc > n) { /* each string takes at least its NUL */
        send_failure(id, EINVAL, "malformed exec request (argc %u, envc %u)", argc, envc);
        return;
    }
    if (find_exec(id)) {
        send_failure(id, EEXIST, "exec id %u is in use", id);
        return;
    }
    struct exec *x = NULL;
    for (int i = 0; i < MAX_EXECS && !x; i++)
        if (!execs[i].used) x = &execs[i];
    if (!x) {
        send_failure(id, EAGAIN, "too many running commands (%d)", MAX_EXECS);
        return;
    }
    char **argv = calloc((size_t)argc + 1, sizeof(char *));
    char **envp = calloc((size_t)envc + 1, sizeof(char *));
    char *s = p + sizeof hdr, *end = p + n;
    char *cwd = next_str(&s, end);
    int ok = argv && envp && cwd;
    for (uint32_t i = 0; ok && i < argc; i++) ok = (argv[i] = next_str(&s, end)) != NULL;
    for (uint32_t i = 0; ok && i < envc; i++) ok = (envp[i] = next_str(&s, end)) != NULL;
    int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1};
    char group[4096];
    int has_group = 0;
    if (!ok) {
        send_failure(id, argv && envp ? EINVAL : ENOMEM, "malformed exec request");
        goto done;
    }
    if (((flags & 1) && pipe2(in, O_CLOEXEC) < 0) || pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0) {
        send_failure(id, errno, "cannot create pipes: %s", strerror(errno));
        goto done;
    }
    if (cg_root && group_path(group, sizeof group, id, NULL) == 0 && (mkdir(group, 0755) == 0 || errno == EEXIST))
        has_group = group_path(group, sizeof group, id, "cgroup.procs") == 0;
    pid_t pid = fork();
    if (pid == 0) child(has_group ? group : NULL, in[0], out[1], err[1], uid, gid, cwd, argv, envp);
    if (pid < 0) {
        send_failure(id, errno, "cannot fork: %s", strerror(errno));
        if (has_group) rmdir_group(id);
        goto done;
    }
    memset(x, 0, sizeof *x);
    x->used = 1;
    x->id = id;
    x->pid = x->pgid = pid;
    x->in_fd = in[1];
    x->out_fd = out[0];
    x->err_fd = err[0];
    in[1] = out[0] = err[0] = -1;
    nexecs++;
    for (int *fd = &x->in_fd; fd <= &x->err_fd; fd++)
        if (*fd >= 0) fcntl(*fd, F_SETFL, O_NONBLOCK);
    int64_t value = pid;
    send_frame('S', id, &value, sizeof value);
done:
    for (int i = 0; i < 2; i++) {
        close_fd(&in[i]);
        close_fd(&out[i]);
        close_fd(&err[i]);
    }
    free(argv);
    free(envp);
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec *x = &execs[i];
            if (!x->used || x->pid != pid) continue;
            x->pid = 0;
            x->reaped = 1;
            x->status = status;
            x->reaped_at = now_ms();
            close_fd(&x->in_fd);
            buf_free(&x->in);
            maybe_finish(x);
            break;
        }
        /* anything else is an orphan, reaped as init (or as subreaper with --fd) */
    }
}

/* --fd mode's end: leave no command behind, and no cgroup either when it can be helped. */
static void shutdown_and_exit(int code) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (execs[i].used) kill_tree(&execs[i], execs[i].id, SIGKILL);
    for (int i = 0; i < nstale; i++) kill_tree(NULL, stale[i], SIGKILL); /* background leftovers */
    for (int64_t until = now_ms() + 500; now_ms() < until;) {
        reap();
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec *x = &execs[i];
            if (!x->used) continue;
            close_fd(&x->out_fd);
            close_fd(&x->err_fd);
            if (x->reaped) finish(x);
        }
        retry_groups();
        if (nexecs == 0 && nstale == 0) break;
        usleep(10000);
    }
    exit(code);
}

/* ---- the port ------------------------------------------------------------------------------------ */

static void disconnect(enum port_state next) {
    inq.off = inq.len = 0;
    outq.off = outq.len = 0;
    enq_total = sent_total = 0;
    for (int i = 0; i < nexits; i++) exits[i].queued_end = 0;
    if (next == PORT_CLOSED) close_fd(&port);
    state = next;
    next_retry = now_ms() + RETRY_MS;
}

static void port_lost(const char *why) {
    if (fd_mode) {
        if (why) logmsg("control fd: %s", why);
        shutdown_and_exit(why ? 1 : 0);
    }
    if (why) logmsg("port: %s; reopening it", why);
    disconnect(why ? PORT_CLOSED : PORT_WAITING);
}

static void protocol_error(const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    logmsg("protocol error: %s", msg);
    if (fd_mode) shutdown_and_exit(3);
    disconnect(PORT_DESYNC);
}

/* Reads and drops what the port holds; -1 if the port failed. */
static int discard_input(void) {
    for (;;) {
        ssize_t n = read(port, scratch, sizeof scratch);
        if (n > 0) continue;
        if (n == 0 || errno == EAGAIN) return 0;
        if (errno != EINTR) return -1;
    }
}

static int read_small(const char *path, char *out, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, out, size - 1);
    close(fd);
    if (n < 0) return -1;
    out[n] = 0;
    out[strcspn(out, "\n")] = 0;
    return 0;
}

static int open_port(void) {
    static int reported;
    DIR *d = opendir(PORTS_DIR);
    int fd = -1;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char path[600], name[128];
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, PORTS_DIR "/%s/name", e->d_name);
        if (read_small(path, name, sizeof name) < 0 || strcmp(name, PORT_NAME) != 0) continue;
        snprintf(path, sizeof path, "/dev/%s", e->d_name);
        fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
        if (fd < 0 && errno == ENOENT) { /* no devtmpfs node (yet): make one from sysfs's dev file */
            char dev[600], num[32];
            unsigned maj, min;
            snprintf(dev, sizeof dev, PORTS_DIR "/%s/dev", e->d_name);
            if (read_small(dev, num, sizeof num) == 0 && sscanf(num, "%u:%u", &maj, &min) == 2 &&
                mknod(path, S_IFCHR | 0600, makedev(maj, min)) == 0)
                fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
        }
        if (fd < 0 && !reported) logmsg("cannot open %s: %s", path, strerror(errno));
        break;
    }
    if (d) closedir(d);
    if (fd < 0 && !reported++) logmsg("waiting for the virtio-serial port " PORT_NAME);
    if (fd >= 0) reported = 0;
    return fd;
}

static void announce(void) {
    state = PORT_CONNECTED;
    send_frame('R', 0, AGENT_VERSION, strlen(AGENT_VERSION));
    for (int i = 0; i < nexits; i++) queue_exit(&exits[i]);
}

/* While no host is connected the port polls as hung up; that clears when one connects. POLLHUP is
 * level-triggered, so the port stays out of the main poll set and is looked at every RETRY_MS. */
static void check_port(void) {
    next_retry = now_ms() + RETRY_MS;
    if (state == PORT_CLOSED) {
        port = open_port();
        if (port < 0) return;
        state = PORT_WAITING;
    }
    struct pollfd p = {.fd = port, .events = POLLIN};
    if (poll(&p, 1, 0) < 0) return;
    if (discard_input() < 0 || (p.revents & (POLLERR | POLLNVAL))) {
        disconnect(PORT_CLOSED);
        return;
    }
    if (!(p.revents & POLLHUP)) announce();
}

static void flush_out(void) {
    while (buf_used(&outq)) {
        ssize_t n = write(port, outq.data + outq.off, buf_used(&outq));
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) break;
            port_lost(errno == EPIPE || errno == ECONNRESET ? NULL : strerror(errno));
            return;
        }
        buf_consumed(&outq, (size_t)n);
        sent_total += (uint64_t)n;
    }
    prune_exits();
}

static void refresh(uint32_t id, const char *p, size_t n) {
    int64_t sec, nsec;
    char reply[2] = {0, 0};
    if (n >= 16) {
        memcpy(&sec, p, 8);
        memcpy(&nsec, p + 8, 8);
        struct timespec ts = {.tv_sec = (time_t)sec, .tv_nsec = (long)nsec};
        reply[0] = clock_settime(CLOCK_REALTIME, &ts) == 0;
        size_t m = n - 16 > 256 ? 256 : n - 16;
        union {
            struct rand_pool_info info;
            char raw[sizeof(struct rand_pool_info) + 256];
        } e;
        e.info.entropy_count = (int)(m * 8);
        e.info.buf_size = (int)m;
        memcpy(e.raw + sizeof(struct rand_pool_info), p + 16, m);
        int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
        /* mixing alone would leave the CRNG's state as it was until its next scheduled reseed */
        reply[1] = fd >= 0 && ioctl(fd, RNDADDENTROPY, &e.info) == 0 && ioctl(fd, RNDRESEEDCRNG) == 0;
        if (fd >= 0) close(fd);
    }
    send_frame('t', id, reply, sizeof reply);
}

static void handle_frame(char type, uint32_t id, char *p, size_t n) {
    uint32_t sig;
    switch (type) {
    case 'E':
        start_exec(id, p, n);
        break;
    case 'I':
        stdin_data(id, p, n);
        break;
    case 'K':
        if (n < 4) break;
        memcpy(&sig, p, 4);
        if (sig > 0 && sig < NSIG) kill_tree(find_exec(id), id, (int)sig);
        break;
    case 'P':
        send_frame('p', id, p, n);
        break;
    case 'T':
        refresh(id, p, n);
        break;
    case 'H': /* whatever was queued for the previous host is not this one's */
        outq.off = outq.len = 0;
        enq_total = sent_total = 0;
        for (int i = 0; i < nexits; i++) exits[i].queued_end = 0;
        announce();
        break;
    default: /* unknown types are skipped: a newer host may send more */
        break;
    }
}

static void read_port(void) {
    if (buf_reserve(&inq, CHUNK) < 0) {
        protocol_error("out of memory for input");
        return;
    }
    ssize_t n = read(port, inq.data + inq.len, CHUNK);
    if (n < 0) {
        if (errno != EINTR && errno != EAGAIN) port_lost(errno == ECONNRESET ? NULL : strerror(errno));
        return;
    }
    if (n == 0) {
        port_lost(NULL);
        return;
    }
    inq.len += (size_t)n;
    while (state == PORT_CONNECTED && buf_used(&inq) >= 4) {
        uint32_t len;
        memcpy(&len, inq.data + inq.off, 4);
        if (len < 5 || len > MAX_FRAME) {
            protocol_error("frame length %u", len);
            return;
        }
        if (buf_used(&inq) < 4 + (size_t)len) break;
        char *f = inq.data + inq.off + 4;
        uint32_t id;
        memcpy(&id, f + 1, 4);
        handle_frame(f[0], id, f + 5, len - 5);
        buf_consumed(&inq, 4 + (size_t)len);
    }
}

/* ---- pid 1 --------------------------------------------------------------------------------------- */

static void mount_fs(const char *src, const char *target, const char *type, unsigned long flags, const char *data) {
    struct stat st, parent;
    char up[256];
    snprintf(up, sizeof up, "%s/..", target);
    mkdir(target, 0755);
    if (stat(target, &st) == 0 && stat(up, &parent) == 0 && st.st_dev != parent.st_dev) return; /* mounted */
    if (mount(src, target, type, flags, data) < 0) logmsg("mount %s on %s: %s", type, target, strerror(errno));
}

static void init_system(void) {
    const int quiet[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGTSTP, SIGTTIN, SIGTTOU};
    for (size_t i = 0; i < sizeof quiet / sizeof quiet[0]; i++) signal(quiet[i], SIG_IGN);
    mount_fs("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount_fs("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount_fs("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    mount_fs("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5");
    mount_fs("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    mount_fs("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    const char *links[][2] = {{"/proc/self/fd", "/dev/fd"}, {"/proc/self/fd/0", "/dev/stdin"},
                              {"/proc/self/fd/1", "/dev/stdout"}, {"/proc/self/fd/2", "/dev/stderr"},
                              {"pts/ptmx", "/dev/ptmx"}};
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++) (void)!symlink(links[i][0], links[i][1]);
    if (sethostname("sandbox", 7) < 0) logmsg("sethostname: %s", strerror(errno));
    setup_cgroups("/sys/fs/cgroup/dsec");
}

/* ---- main loop ----------------------------------------------------------------------------------- */

enum { W_IN, W_OUT, W_ERR };
static struct pollfd pfds[2 + 3 * MAX_EXECS];
static struct {
    int slot;
    int which;
    uint32_t id;
} pmap[2 + 3 * MAX_EXECS];

static void sooner(int *timeout, int64_t deadline, int64_t now) {
    int64_t left = deadline > now ? deadline - now : 0;
    if (*timeout < 0 || left < *timeout) *timeout = (int)left;
}

static void serve(void) {
    int rr = 0;
    for (;;) {
        int64_t now = now_ms();
        if (!fd_mode && (state == PORT_CLOSED || state == PORT_WAITING) && now >= next_retry) check_port();
        int n = 0, timeout = -1, port_idx = -1;
        pfds[n++] = (struct pollfd){.fd = sfd, .events = POLLIN};
        if (state == PORT_CONNECTED || state == PORT_DESYNC) {
            short ev = POLLIN | (state == PORT_CONNECTED && buf_used(&outq) ? POLLOUT : 0);
            port_idx = n;
            pfds[n++] = (struct pollfd){.fd = port, .events = ev};
        }
        int first_exec = n;
        int reading = state != PORT_CONNECTED || buf_used(&outq) < OUT_HIGH;
        rr = (rr + 1) % MAX_EXECS; /* rotate so that no command's output always goes first */
        for (int k = 0, seen = 0; k < MAX_EXECS && seen < nexecs; k++) {
            int i = (rr + k) % MAX_EXECS;
            struct exec *x = &execs[i];
            if (!x->used) continue;
            seen++;
            int fds[3] = {x->in_fd, x->out_fd, x->err_fd};
            short evs[3] = {buf_used(&x->in) ? POLLOUT : 0, reading ? POLLIN : 0, reading ? POLLIN : 0};
            for (int w = 0; w < 3; w++) {
                if (fds[w] < 0 || !evs[w]) continue;
                pmap[n].slot = i;
                pmap[n].which = w;
                pmap[n].id = x->id;
                pfds[n++] = (struct pollfd){.fd = fds[w], .events = evs[w]};
            }
            if (x->reaped) sooner(&timeout, x->reaped_at + GRACE_MS, now);
        }
        if (!fd_mode && (state == PORT_CLOSED || state == PORT_WAITING)) sooner(&timeout, next_retry, now);
        if (nstale) sooner(&timeout, next_cg_retry, now);
        if (poll(pfds, (nfds_t)n, timeout) < 0) {
            if (errno != EINTR) usleep(10000); /* never spin, never die */
            continue;
        }
        if (pfds[0].revents) {
            struct signalfd_siginfo info;
            while (read(sfd, &info, sizeof info) > 0) {
            }
            reap();
        }
        if (port_idx >= 0 && pfds[port_idx].revents) {
            short re = pfds[port_idx].revents;
            if (state == PORT_DESYNC) {
                if (re & (POLLHUP | POLLERR | POLLNVAL)) disconnect(re & POLLHUP ? PORT_WAITING : PORT_CLOSED);
                else if (discard_input() < 0) disconnect(PORT_CLOSED);
            } else if (!fd_mode && (re & POLLHUP)) {
                port_lost(NULL); /* the host hung up; what it sent last has nobody to answer */
            } else if (!fd_mode && (re & (POLLERR | POLLNVAL))) {
                port_lost("poll error");
            } else {
                if (re & (POLLIN | POLLHUP | POLLERR)) read_port();
                if (state == PORT_CONNECTED && (re & POLLOUT)) flush_out();
            }
        }
        for (int k = first_exec; k < n; k++) {
            if (!pfds[k].revents) continue;
            struct exec *x = &execs[pmap[k].slot];
            if (!x->used || x->id != pmap[k].id) continue; /* finished meanwhile */
            int which = pmap[k].which;
            int *fd = which == W_IN ? &x->in_fd : which == W_OUT ? &x->out_fd : &x->err_fd;
            if (*fd != pfds[k].fd) continue;
            if (which == W_IN) {
                if (pfds[k].revents & (POLLERR | POLLHUP)) { /* the command closed its stdin */
                    x->in_eof = 1;
                    buf_free(&x->in);
                }
                write_stdin(x);
            } else {
                pump(x, fd, which == W_OUT ? 'O' : 'e', CHUNK);
                maybe_finish(x);
            }
        }
        now = now_ms();
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec *x = &execs[i];
            if (!x->used || !x->reaped || now < x->reaped_at + GRACE_MS) continue;
            /* background processes hold the pipes: take what is there, then stop listening */
            pump(x, &x->out_fd, 'O', FINAL_DRAIN);
            pump(x, &x->err_fd, 'e', FINAL_DRAIN);
            close_fd(&x->out_fd);
            close_fd(&x->err_fd);
            finish(x);
        }
        if (nstale && now >= next_cg_retry) retry_groups();
        if (state == PORT_CONNECTED && buf_used(&outq)) flush_out();
    }
}

static void keep_std_fds(void) {
    for (int fd = 0; fd < 3; fd++) {
        if (fcntl(fd, F_GETFD) >= 0) continue;
        int n = open("/dev/null", O_RDWR);
        if (n >= 0 && n != fd) {
            dup2(n, fd);
            close(n);
        }
    }
}

int main(int argc, char **argv) {
    const char *cgroup_dir = NULL;
    int fd = -1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--fd") == 0 && i + 1 < argc) fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "--cgroup-root") == 0 && i + 1 < argc) cgroup_dir = argv[++i];
        else if (getpid() != 1) {
            fprintf(stderr, "usage: %s [--fd N [--cgroup-root DIR]]\n", argv[0]);
            return 2;
        }
    }
    keep_std_fds();
    prctl(PR_SET_DUMPABLE, 0);
    signal(SIGPIPE, SIG_IGN);
    if (fd >= 0) {
        if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0 || fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0) {
            fprintf(stderr, "dsec-agent: --fd %d: %s\n", fd, strerror(errno));
            return 2;
        }
        fd_mode = 1;
        port = fd;
        if (cgroup_dir) setup_cgroups(cgroup_dir);
    } else if (getpid() == 1) {
        init_system();
    }
    /* orphans of the commands come back to us to be reaped (as pid 1 they do anyway) */
    if (getpid() != 1) prctl(PR_SET_CHILD_SUBREAPER, 1);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    while ((sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK)) < 0) {
        if (fd_mode) return 1;
        logmsg("signalfd: %s", strerror(errno)); /* pid 1 must not exit */
        sleep(1);
    }
    if (fd_mode) announce();
    serve();
}
