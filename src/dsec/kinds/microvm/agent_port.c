/* dsec guest agent: the virtio-serial port (found by name, reopened when it fails) and the frames on it. */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

/* ---- the port ------------------------------------------------------------------------------------ */

void disconnect(enum port_state next) {
    inq.off = inq.len = 0;
    outq.off = outq.len = 0;
    enq_total = sent_total = 0;
    for (int i = 0; i < nexits; i++) exits[i].queued_end = 0;
    if (next == PORT_CLOSED) close_fd(&port);
    state = next;
    next_retry = now_ms() + RETRY_MS;
}

void port_lost(const char *why) {
    if (mode == MODE_FD) {
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
    if (mode == MODE_FD) shutdown_and_exit(3);
    disconnect(PORT_DESYNC);
}

/* Reads and drops what the port holds; -1 if the port failed. */
int discard_input(void) {
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

void announce(void) {
    state = PORT_CONNECTED;
    send_frame('R', 0, AGENT_VERSION, strlen(AGENT_VERSION));
    for (int i = 0; i < nexits; i++) queue_exit(&exits[i]);
}

/* While no host is connected the port polls as hung up; that clears when one connects. POLLHUP is
 * level-triggered, so the port stays out of the main poll set and is looked at every RETRY_MS. */
void check_port(void) {
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

void flush_out(void) {
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
    case 'W':
        resize_terminal(id, p, n);
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

void read_port(void) {
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
