/* dsec guest agent: the state its parts share, logging, buffers, frames and undelivered exit statuses. */
#include "agent.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum agent_mode mode = MODE_PID1;
int port = -1, sfd = -1;
enum port_state state = PORT_CLOSED;
int64_t next_retry, next_cg_retry;
const char *cg_root;
struct buf inq, outq;
uint64_t enq_total, sent_total;
struct exec execs[MAX_EXECS];
int nexecs;
struct exit_rec exits[MAX_EXITS];
int nexits;
uint32_t stale[MAX_STALE];
int nstale;
char scratch[CHUNK];

void logmsg(const char *fmt, ...) {
    /* one write per message: beside the image's init, stderr is /dev/kmsg, where each write is a record
     * (level 3, so that it reaches a console the kernel keeps quiet) */
    char msg[1024];
    int n = snprintf(msg, sizeof msg, "%sdsec-agent: ", mode == MODE_IMAGE_INIT ? "<3>" : "");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(msg + n, sizeof msg - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0) m = 0;
    if ((size_t)(n + m) > sizeof msg - 2) m = (int)sizeof msg - 2 - n;
    msg[n + m] = '\n';
    (void)!write(2, msg, (size_t)(n + m + 1));
}

int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* ---- buffers and frames -------------------------------------------------------------------------- */

size_t buf_used(const struct buf *b) { return b->len - b->off; }

int buf_reserve(struct buf *b, size_t extra) {
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

void buf_consumed(struct buf *b, size_t n) {
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

void buf_free(struct buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

/* Room for one frame of up to max payload bytes in the output queue, or NULL (not connected, no memory). */
char *frame_start(size_t max) {
    if (state != PORT_CONNECTED || buf_reserve(&outq, HDR + max) < 0) return NULL;
    return outq.data + outq.len + HDR;
}

void frame_commit(char type, uint32_t id, size_t n) {
    uint32_t len = (uint32_t)(5 + n);
    char *h = outq.data + outq.len;
    memcpy(h, &len, 4);
    h[4] = type;
    memcpy(h + 5, &id, 4);
    outq.len += HDR + n;
    enq_total += HDR + n;
}

int send_frame(char type, uint32_t id, const void *payload, size_t n) {
    char *dst = frame_start(n);
    if (!dst) return -1;
    if (n) memcpy(dst, payload, n);
    frame_commit(type, id, n);
    return 0;
}

void send_failure(uint32_t id, int err, const char *fmt, ...) {
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

void prune_exits(void) {
    int j = 0;
    for (int i = 0; i < nexits; i++)
        if (!(exits[i].queued_end && exits[i].queued_end <= sent_total)) exits[j++] = exits[i];
    nexits = j;
}

void queue_exit(struct exit_rec *r) {
    unsigned char payload[5];
    memcpy(payload, &r->status, 4);
    payload[4] = r->flags;
    if (send_frame('X', r->id, payload, sizeof payload) == 0) r->queued_end = enq_total;
}

void report_exit(uint32_t id, int status, uint8_t flags) {
    if (nexits == MAX_EXITS) { /* nobody has listened for a long time: forget the oldest */
        logmsg("too many undelivered exit statuses; dropping exec %u's", exits[0].id);
        memmove(exits, exits + 1, sizeof exits[0] * (MAX_EXITS - 1));
        nexits--;
    }
    struct exit_rec *r = &exits[nexits++];
    r->id = id;
    r->status = status;
    r->flags = flags;
    r->queued_end = 0;
    queue_exit(r);
}
