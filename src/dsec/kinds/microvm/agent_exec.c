/* dsec guest agent: commands (fork, pipes, users, stdin, output, exit) and the cgroups that bound them. */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

extern char **environ;

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

void retry_groups(void) {
    int j = 0;
    for (int i = 0; i < nstale; i++)
        if (rmdir_group(stale[i]) != 0) stale[j++] = stale[i];
    nstale = j;
    next_cg_retry = now_ms() + CG_RETRY_MS;
}

/* Exec cgroups under dir; returns 0 when they can be used. quiet: say nothing when they cannot. */
int setup_cgroups(const char *dir, int quiet) {
    struct statfs sf;
    if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
        if (!quiet) logmsg("no exec cgroups (mkdir %s: %s); killing process groups instead", dir, strerror(errno));
        return -1;
    }
    if (statfs(dir, &sf) < 0 || sf.f_type != CGROUP2_MAGIC || access(dir, W_OK) < 0) {
        if (!quiet)
            logmsg("no exec cgroups (%s is not a writable cgroup2 directory); killing process groups instead", dir);
        return -1;
    }
    cg_root = dir;
    return 0;
}

/* Beside the image's init, cgroup2 is whatever that init mounted (systemd does, early; busybox's init
 * does not): looked for before each command, and the agent never mounts /sys/fs/cgroup itself, so that
 * the init finds it as it expects it. An init that mounts no cgroup2 would leave the agent with process
 * groups only, which a command escapes with setsid(); once the init has had its time (the first command
 * comes after the host saw the guest settle), the agent mounts the same hierarchy on a private directory
 * of its own instead. */
static int init_without_cgroups(void) {
    struct stat init_root, own_root;
    char exe[256];
    /* still the initramfs's pid 1: the image's init has not started yet */
    if (stat("/proc/1/root/", &init_root) < 0 || stat("/", &own_root) < 0 || init_root.st_dev != own_root.st_dev ||
        init_root.st_ino != own_root.st_ino)
        return 0;
    ssize_t n = readlink("/proc/1/exe", exe, sizeof exe - 1);
    if (n <= 0) return 0;
    exe[n] = 0;
    const char *base = strrchr(exe, '/');
    return !(base && strcmp(base, "/systemd") == 0); /* systemd mounts its own, early */
}

void adopt_cgroups(void) {
    struct statfs sf;
    if (cg_root) return;
    if (statfs(CGROUP_MOUNT, &sf) == 0 && sf.f_type == CGROUP2_MAGIC) {
        if (setup_cgroups(CGROUP_DIR, 1) == 0) logmsg("exec cgroups under " CGROUP_DIR);
        return;
    }
    if (!init_without_cgroups()) return;
    if (mkdir(PRIVATE_CGROUP, 0700) < 0 && errno != EEXIST) return;
    if ((statfs(PRIVATE_CGROUP, &sf) == 0 && sf.f_type == CGROUP2_MAGIC) ||
        mount("cgroup2", PRIVATE_CGROUP, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) == 0) {
        if (setup_cgroups(PRIVATE_CGROUP "/dsec", 1) == 0) logmsg("exec cgroups under " PRIVATE_CGROUP "/dsec");
    }
}

/* ---- commands ------------------------------------------------------------------------------------ */

struct exec *find_exec(uint32_t id) {
    for (int i = 0, seen = 0; i < MAX_EXECS && seen < nexecs; i++) {
        if (!execs[i].used) continue;
        seen++;
        if (execs[i].id == id) return &execs[i];
    }
    return NULL;
}

void kill_tree(struct exec *x, uint32_t id, int sig) {
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

/* The guest kernel's count of OOM kills (/proc/vmstat oom_kill); 0 when unknown. */
uint64_t oom_kills(void) {
    FILE *f = fopen("/proc/vmstat", "re");
    if (!f) return 0;
    char name[64];
    unsigned long long v, found = 0;
    while (fscanf(f, "%63s %llu", name, &v) == 2)
        if (strcmp(name, "oom_kill") == 0) {
            found = v;
            break;
        }
    fclose(f);
    return found;
}

void finish(struct exec *x) {
    /* a VM's memory is the sandbox's: an OOM kill anywhere in the guest while the command ran is the
     * command's (the host's memory cgroup of a container reports the same) */
    report_exit(x->id, x->status, oom_kills() > x->oom_start ? EXIT_OOM : 0);
    close_fd(&x->in_fd);
    close_fd(&x->out_fd);
    close_fd(&x->err_fd);
    buf_free(&x->in);
    if (cg_root) remove_group(x->id);
    memset(x, 0, sizeof *x);
    nexecs--;
}

void maybe_finish(struct exec *x) {
    if (x->reaped && x->out_fd < 0 && x->err_fd < 0) finish(x);
}

/* Forward what a command's stdout/stderr holds, up to budget bytes; closes the fd at EOF. */
void pump(struct exec *x, int *fd, char type, size_t budget) {
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

void write_stdin(struct exec *x) {
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

void stdin_data(uint32_t id, const char *p, size_t n) {
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

void resize_terminal(uint32_t id, const char *p, size_t n) {
    struct exec *x = find_exec(id);
    uint32_t size[2];
    if (!x || !x->terminal || n < sizeof size) return;
    memcpy(size, p, sizeof size);
    struct winsize ws = {.ws_row = (unsigned short)size[0], .ws_col = (unsigned short)size[1]};
    int fd = x->out_fd >= 0 ? x->out_fd : x->in_fd;
    if (fd >= 0) (void)ioctl(fd, TIOCSWINSZ, &ws); /* the kernel sends the foreground group SIGWINCH */
}

/* A new pseudo-terminal, unlocked and sized: returns the master and puts the slave (opened from the
 * master, no path involved) in *slave; -1 with errno on failure. */
static int open_terminal(uint32_t rows, uint32_t cols, uint32_t uid, int *slave) {
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
    if (uid) (void)!fchown(*slave, uid, (gid_t)-1); /* the account's terminal, as login(1) makes it */
    return master;
}

/* terminal: in_fd (= out_fd = err_fd) is a terminal's slave, to become the controlling terminal */
static void child(const char *procs, int in_fd, int out_fd, int err_fd, int terminal, uint32_t uid, uint32_t gid,
                  const char *cwd, char **argv, char **envp, const uint64_t *limits) {
    for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL); /* ignored dispositions would survive exec */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setsid();
    if (terminal && ioctl(in_fd, TIOCSCTTY, 0) < 0) {
        dprintf(err_fd, "dsec: cannot take the terminal: %s\n", strerror(errno));
        _exit(125);
    }
    if (procs) { /* best effort: without it the process group still reaches the tree */
        int fd = open(procs, O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            (void)!write(fd, "0", 1);
            close(fd);
        }
    }
    if (mode == MODE_IMAGE_INIT) { /* the agent's exemption from the OOM killer is not the command's */
        int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            (void)!write(fd, "0", 1);
            close(fd);
        }
    }
    if (limits) { /* the sandbox's limits, set while still root (raising a hard limit needs it) */
        struct rlimit nofile = {limits[0], limits[0]}, fsize = {limits[1], limits[1]};
        if (setrlimit(RLIMIT_NOFILE, &nofile) < 0 || setrlimit(RLIMIT_FSIZE, &fsize) < 0) {
            dprintf(err_fd, "dsec: cannot set resource limits: %s\n", strerror(errno));
            _exit(125);
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

void start_exec(uint32_t id, char *p, size_t n) {
    uint32_t hdr[5];
    if (n < sizeof hdr) {
        send_failure(id, EINVAL, "malformed exec request");
        return;
    }
    memcpy(hdr, p, sizeof hdr);
    uint32_t argc = hdr[0], envc = hdr[1], flags = hdr[2], uid = hdr[3], gid = hdr[4];
    uint64_t limits[2];
    uint32_t size[2] = {0, 0};
    size_t skip = sizeof hdr;
    if (flags & FLAG_RLIMITS) {
        if (n < sizeof hdr + sizeof limits) {
            send_failure(id, EINVAL, "malformed exec request (limits)");
            return;
        }
        memcpy(limits, p + sizeof hdr, sizeof limits);
        skip += sizeof limits;
    }
    if (flags & FLAG_PTY) {
        if (n < skip + sizeof size) {
            send_failure(id, EINVAL, "malformed exec request (terminal size)");
            return;
        }
        memcpy(size, p + skip, sizeof size);
        skip += sizeof size;
    }
    if (argc == 0 || (uint64_t)argc + envc > n - skip) { /* each string takes at least its NUL */
        send_failure(id, EINVAL, "malformed exec request (argc %u, envc %u)", argc, envc);
        return;
    }
    if (find_exec(id)) {
        send_failure(id, EEXIST, "exec id %u is in use", id);
        return;
    }
    if (mode == MODE_IMAGE_INIT) adopt_cgroups();
    struct exec *x = NULL;
    for (int i = 0; i < MAX_EXECS && !x; i++)
        if (!execs[i].used) x = &execs[i];
    if (!x) {
        send_failure(id, EAGAIN, "too many running commands (%d)", MAX_EXECS);
        return;
    }
    char **argv = calloc((size_t)argc + 1, sizeof(char *));
    char **envp = calloc((size_t)envc + 1, sizeof(char *));
    char *s = p + skip, *end = p + n;
    char *cwd = next_str(&s, end);
    int ok = argv && envp && cwd;
    for (uint32_t i = 0; ok && i < argc; i++) ok = (argv[i] = next_str(&s, end)) != NULL;
    for (uint32_t i = 0; ok && i < envc; i++) ok = (envp[i] = next_str(&s, end)) != NULL;
    /* pipes as pipe2 makes them; a terminal: in[0] its slave (the child's), out[0] and in[1] its master */
    int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1};
    int terminal = (flags & FLAG_PTY) != 0;
    char group[4096];
    int has_group = 0;
    if (!ok) {
        send_failure(id, argv && envp ? EINVAL : ENOMEM, "malformed exec request");
        goto done;
    }
    if (terminal) {
        int slave = -1, master = open_terminal(size[0], size[1], uid, &slave);
        if (master < 0) {
            send_failure(id, errno, "cannot make a terminal: %s", strerror(errno));
            goto done;
        }
        in[0] = slave;
        out[0] = master;
        in[1] = fcntl(master, F_DUPFD_CLOEXEC, 0);
        if (in[1] < 0) {
            send_failure(id, errno, "cannot make a terminal: %s", strerror(errno));
            goto done;
        }
    } else if (((flags & FLAG_STDIN) && pipe2(in, O_CLOEXEC) < 0) || pipe2(out, O_CLOEXEC) < 0 ||
               pipe2(err, O_CLOEXEC) < 0) {
        send_failure(id, errno, "cannot create pipes: %s", strerror(errno));
        goto done;
    }
    if (cg_root && group_path(group, sizeof group, id, NULL) == 0 && (mkdir(group, 0755) == 0 || errno == EEXIST))
        has_group = group_path(group, sizeof group, id, "cgroup.procs") == 0;
    uint64_t oom_start = oom_kills();
    pid_t pid = fork();
    if (pid == 0) {
        if (terminal) child(has_group ? group : NULL, in[0], in[0], in[0], 1, uid, gid, cwd, argv, envp,
                            (flags & FLAG_RLIMITS) ? limits : NULL);
        child(has_group ? group : NULL, in[0], out[1], err[1], 0, uid, gid, cwd, argv, envp,
              (flags & FLAG_RLIMITS) ? limits : NULL);
    }
    if (pid < 0) {
        send_failure(id, errno, "cannot fork: %s", strerror(errno));
        if (has_group) rmdir_group(id);
        goto done;
    }
    memset(x, 0, sizeof *x);
    x->used = 1;
    x->id = id;
    x->pid = x->pgid = pid;
    x->oom_start = oom_start;
    x->terminal = terminal;
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

void reap(void) {
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
void shutdown_and_exit(int code) {
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
