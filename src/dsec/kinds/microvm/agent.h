/*
 * dsec guest agent: what its parts share. The wire protocol and the agent's modes are described in
 * guest_agent.c; agent_io.c holds the shared state, buffers and frames, agent_exec.c the commands and
 * their cgroups, agent_port.c the virtio-serial port and the frames that arrive on it.
 */
#ifndef DSEC_AGENT_H
#define DSEC_AGENT_H

#define _GNU_SOURCE
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire format is little endian and frames are copied as native integers"
#endif

#define AGENT_VERSION "dsec-guest-agent/2" /* 2: terminals (FLAG_PTY, 'W') */
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
#define CGROUP_MOUNT "/sys/fs/cgroup"
#define CGROUP_DIR CGROUP_MOUNT "/dsec"
#define PRIVATE_CGROUP "/dev/.dsec-cgroup" /* beside an init that mounts no cgroup2 (kind vm) */
#define FLAG_STDIN 1u
#define FLAG_RLIMITS 2u /* u64 RLIMIT_NOFILE, u64 RLIMIT_FSIZE follow the exec header */
#define FLAG_PTY 4u     /* u32 rows, u32 cols follow (after the limits): the command runs on a terminal */
#define SHM_SIZE "67108864" /* /dev/shm of a microvm, as a container's */

struct buf {
    char *data;
    size_t off, len, cap;
};

struct exec {
    int used;
    uint32_t id;
    pid_t pid;  /* 0 once reaped */
    pid_t pgid; /* kept after the reap: background members may still run */
    int in_fd, out_fd, err_fd; /* on a terminal: in_fd and out_fd are its master (two descriptors) */
    int terminal;
    struct buf in;
    int in_eof;
    int reaped, status;
    int64_t reaped_at;
    uint64_t oom_start; /* the guest's OOM kill count when the command started */
};

struct exit_rec {
    uint32_t id;
    int32_t status;
    uint8_t flags; /* EXIT_OOM */
    uint64_t queued_end; /* enq_total after its 'X' was queued; 0: not queued on this connection */
};

enum port_state { PORT_CLOSED, PORT_WAITING, PORT_CONNECTED, PORT_DESYNC };

/* the agent's mode: --fd (tests), pid 1 (microvm), or beside the image's own init (vm) */
enum agent_mode { MODE_FD, MODE_PID1, MODE_IMAGE_INIT };

extern enum agent_mode mode;
extern int port, sfd;
extern enum port_state state;
extern int64_t next_retry, next_cg_retry;
extern const char *cg_root;
extern struct buf inq, outq;
extern uint64_t enq_total, sent_total;
extern struct exec execs[MAX_EXECS];
extern int nexecs;
extern struct exit_rec exits[MAX_EXITS];
extern int nexits;
extern uint32_t stale[MAX_STALE];
extern int nstale;
extern char scratch[CHUNK];

/* agent_io.c */
void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int64_t now_ms(void);
void close_fd(int *fd);
size_t buf_used(const struct buf *b);
int buf_reserve(struct buf *b, size_t extra);
void buf_consumed(struct buf *b, size_t n);
void buf_free(struct buf *b);
char *frame_start(size_t max);
void frame_commit(char type, uint32_t id, size_t n);
int send_frame(char type, uint32_t id, const void *payload, size_t n);
void send_failure(uint32_t id, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void prune_exits(void);
void queue_exit(struct exit_rec *r);
#define EXIT_OOM 1 /* the guest killed a process for lack of memory while the command ran */
void report_exit(uint32_t id, int status, uint8_t flags);
uint64_t oom_kills(void);

/* agent_exec.c */
int setup_cgroups(const char *dir, int quiet);
void adopt_cgroups(void);
void retry_groups(void);
struct exec *find_exec(uint32_t id);
void kill_tree(struct exec *x, uint32_t id, int sig);
void finish(struct exec *x);
void maybe_finish(struct exec *x);
void pump(struct exec *x, int *fd, char type, size_t budget);
void write_stdin(struct exec *x);
void stdin_data(uint32_t id, const char *p, size_t n);
void resize_terminal(uint32_t id, const char *p, size_t n);
void start_exec(uint32_t id, char *p, size_t n);
void reap(void);
void shutdown_and_exit(int code) __attribute__((noreturn));

/* agent_port.c */
void disconnect(enum port_state next);
void port_lost(const char *why);
int discard_input(void);
void announce(void);
void check_port(void);
void flush_out(void);
void read_port(void);

#endif
