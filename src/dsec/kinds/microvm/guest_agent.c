/*
 * dsec guest agent: the executor of a microvm/vm sandbox's commands, from a read-only device at /.dsec.
 *
 * Modes:
 *   pid 1 (kind microvm)   the initramfs execs it after switch_root; it mounts /proc, /sys, /dev and
 *                          cgroup2 itself.
 *   --image-init (kind vm) the initramfs runs it chrooted into the new root before it hands pid 1 to the
 *                          image's own init (systemd, busybox init...). It forks a daemon and the parent
 *                          exits, so the initramfs knows the daemon's root is set before it switches root.
 *                          The daemon mounts nothing (/proc, /sys, /dev came from the initramfs; cgroup2
 *                          is the init's), leaves the console's session, logs to /dev/kmsg, is spared by
 *                          the OOM killer and renames itself "@dsec-agent": systemd spares processes whose
 *                          argv[0] starts with '@' when it kills everything at shutdown.
 *   --fd N (tests)         see below.
 *
 * It talks to the daemon over the virtio-serial port named "dsec.agent" (QEMU turns the host side into a
 * unix socket). No fds can cross that port, so a command's output travels as frames and the agent owns
 * its pipes. Sources: this file (modes, main loop), agent_io.c (state, frames), agent_exec.c
 * (commands, cgroups), agent_port.c (the port, incoming frames); agent.h declares what they share.
 *
 * Frames, both ways, all integers little endian:  u32 len | u8 type | u32 id | payload  (len = 5 + payload)
 *   host -> agent  'E' exec      u32 argc u32 envc u32 flags u32 uid u32 gid | cwd\0 argv...\0 env...\0
 *                                flags bit 0: stdin follows as 'I' frames (else stdin is /dev/null)
 *                                flags bit 1: u64 RLIMIT_NOFILE u64 RLIMIT_FSIZE follow the five u32s
 *                                (before the strings); the command starts with them
 *                                flags bit 2: u32 rows u32 cols follow (after the limits): the command
 *                                runs on a new pseudo-terminal of that size, its controlling terminal and
 *                                stdio; its input comes as 'I' frames, its output as 'O'
 *                  'I' stdin     bytes; an empty payload closes the command's stdin
 *                  'W' winsize   u32 rows u32 cols: the exec's terminal's new size (SIGWINCH follows)
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
 *                  'X' exited    i32 raw wait status, u8 flags (bit 0: the guest OOM-killed a process while
 *                                the command ran); after all of the exec's 'O'/'e'
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
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- pid 1 --------------------------------------------------------------------------------------- */

static void mount_fs(const char *src, const char *target, const char *type, unsigned long flags, const char *data) {
    struct stat st, parent;
    char up[256];
    snprintf(up, sizeof up, "%s/..", target);
    mkdir(target, 0755);
    if (stat(target, &st) == 0 && stat(up, &parent) == 0 && st.st_dev != parent.st_dev) return; /* mounted */
    if (mount(src, target, type, flags, data) < 0) logmsg("mount %s on %s: %s", type, target, strerror(errno));
}

static void ignore_signals(void) {
    const int quiet[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGTSTP, SIGTTIN, SIGTTOU};
    for (size_t i = 0; i < sizeof quiet / sizeof quiet[0]; i++) signal(quiet[i], SIG_IGN);
}

static void init_system(void) {
    ignore_signals();
    mount_fs("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount_fs("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount_fs("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    mount_fs("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5");
    mount_fs("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=" SHM_SIZE ",nr_inodes=16384");
    mount_fs("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    const char *links[][2] = {{"/proc/self/fd", "/dev/fd"}, {"/proc/self/fd/0", "/dev/stdin"},
                              {"/proc/self/fd/1", "/dev/stdout"}, {"/proc/self/fd/2", "/dev/stderr"},
                              {"pts/ptmx", "/dev/ptmx"}};
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++) (void)!symlink(links[i][0], links[i][1]);
    if (sethostname("sandbox", 7) < 0) logmsg("sethostname: %s", strerror(errno));
    setup_cgroups(CGROUP_DIR, 0);
}

/* ---- beside the image's init --------------------------------------------------------------------- */

static void redirect(int target, const char *path, int flags) {
    int fd = open(path, flags | O_CLOEXEC);
    if (fd < 0) fd = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (fd >= 0 && fd != target) {
        dup2(fd, target);
        close(fd);
    }
}

static void beside_init(char **argv) {
    if (argv[0][0] != '@') {
        char *args[] = {"@dsec-agent", "--image-init", NULL};
        execv("/proc/self/exe", args);
        logmsg("cannot rename itself (exec /proc/self/exe: %s); systemd may stop it at shutdown", strerror(errno));
    }
    prctl(PR_SET_NAME, "dsec-agent"); /* else its name is the "exe" of /proc/self/exe */
    pid_t pid = fork();
    if (pid < 0) {
        logmsg("fork: %s", strerror(errno));
        exit(1);
    }
    if (pid > 0) _exit(0);
    setsid(); /* out of the console's session: a getty's vhangup there must not reach the agent */
    ignore_signals();
    redirect(0, "/dev/null", O_RDONLY);
    redirect(1, "/dev/null", O_WRONLY);
    redirect(2, "/dev/kmsg", O_WRONLY);
    if (chdir("/") < 0) logmsg("chdir /: %s", strerror(errno));
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, "-1000", 5) != 5) logmsg("the OOM killer may pick the agent: %s", strerror(errno));
    if (fd >= 0) close(fd);
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
        if (mode != MODE_FD && (state == PORT_CLOSED || state == PORT_WAITING) && now >= next_retry) check_port();
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
        if (mode != MODE_FD && (state == PORT_CLOSED || state == PORT_WAITING)) sooner(&timeout, next_retry, now);
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
            } else if (mode != MODE_FD && (re & POLLHUP)) {
                port_lost(NULL); /* the host hung up; what it sent last has nobody to answer */
            } else if (mode != MODE_FD && (re & (POLLERR | POLLNVAL))) {
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
    int fd = -1, image_init = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--fd") == 0 && i + 1 < argc) fd = atoi(argv[++i]);
        else if (strcmp(argv[i], "--cgroup-root") == 0 && i + 1 < argc) cgroup_dir = argv[++i];
        else if (strcmp(argv[i], "--image-init") == 0) image_init = 1;
        else if (getpid() != 1) { /* as pid 1, arguments are whatever the kernel passed on */
            fprintf(stderr, "usage: %s [--image-init | --fd N [--cgroup-root DIR]]\n", argv[0]);
            return 2;
        }
    }
    mode = fd >= 0 ? MODE_FD : image_init ? MODE_IMAGE_INIT : MODE_PID1;
    keep_std_fds();
    if (mode == MODE_IMAGE_INIT) beside_init(argv);
    prctl(PR_SET_DUMPABLE, 0);
    signal(SIGPIPE, SIG_IGN);
    if (mode == MODE_FD) {
        if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0 || fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0) {
            fprintf(stderr, "dsec-agent: --fd %d: %s\n", fd, strerror(errno));
            return 2;
        }
        port = fd;
        if (cgroup_dir) setup_cgroups(cgroup_dir, 0);
    } else if (mode == MODE_PID1 && getpid() == 1) {
        init_system();
    }
    /* orphans of the commands come back to us to be reaped (as pid 1 they do anyway) */
    if (getpid() != 1) prctl(PR_SET_CHILD_SUBREAPER, 1);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    while ((sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK)) < 0) {
        if (mode == MODE_FD) return 1;
        logmsg("signalfd: %s", strerror(errno)); /* the agent of a VM must not exit */
        sleep(1);
    }
    if (mode == MODE_FD) announce();
    serve();
}
