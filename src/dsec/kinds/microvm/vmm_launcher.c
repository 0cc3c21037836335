/* dsec-vmm-launcher: puts the calling process in the VMM jail, then becomes QEMU (execve), so the pid
 * the daemon spawned is QEMU's own and waiting for it or killing it works as before.
 *
 *   dsec-vmm-launcher --root DIR --uid N --gid N [--cgroup DIR]... [--ro PATH]... [--ro-exec PATH]...
 *                     [--link PATH TARGET]... [--dev PATH MAJOR MINOR MODE OWNER]... -- QEMU ARGS...
 *   dsec-vmm-launcher --tsc-khz      (prints the host's TSC frequency, which a TCG guest's TSC runs at)
 *
 * Order matters: the cgroups are joined while /sys is still visible; the mounts are made while the
 * host's tree is still visible; capabilities are dropped only after everything that needs root. Any
 * failure exits 127 with one line on stderr (the VM's qemu.log), before QEMU ever runs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#define MAX_ITEMS 256

struct device {
    const char *path;
    unsigned major, minor, mode;
    int vmm_owned;
};

static const char *root;
static uid_t uid = (uid_t)-1;
static gid_t gid = (gid_t)-1;
static const char *cgroups[MAX_ITEMS];
static int n_cgroups;
static const char *ro[MAX_ITEMS];
static int ro_exec[MAX_ITEMS];
static int n_ro;
static const char *links[MAX_ITEMS][2];
static int n_links;
static struct device devices[MAX_ITEMS];
static int n_devices;

static void die(const char *what, const char *arg) {
    int e = errno;
    dprintf(2, "dsec-vmm-launcher: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", e ? strerror(e) : "invalid");
    _exit(127);
}

static unsigned long number(const char *s, const char *what) {
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 0);
    if (errno || *s == '\0' || *end != '\0') {
        errno = EINVAL;
        die(what, s);
    }
    return v;
}

static void need(int argc, int i, int count, const char *opt) {
    if (i + count >= argc) {
        errno = EINVAL;
        die("missing value for", opt);
    }
}

static void full(int n, const char *opt) {
    if (n >= MAX_ITEMS) {
        errno = E2BIG;
        die("too many", opt);
    }
}

static int parse(int argc, char **argv) {
    int i = 1;
    for (; i < argc; i++) {
        const char *opt = argv[i];
        if (strcmp(opt, "--") == 0)
            return i + 1;
        if (strcmp(opt, "--root") == 0) {
            need(argc, i, 1, opt);
            root = argv[++i];
        } else if (strcmp(opt, "--uid") == 0) {
            need(argc, i, 1, opt);
            uid = (uid_t)number(argv[++i], "uid");
        } else if (strcmp(opt, "--gid") == 0) {
            need(argc, i, 1, opt);
            gid = (gid_t)number(argv[++i], "gid");
        } else if (strcmp(opt, "--cgroup") == 0) {
            need(argc, i, 1, opt);
            full(n_cgroups, opt);
            cgroups[n_cgroups++] = argv[++i];
        } else if (strcmp(opt, "--ro") == 0 || strcmp(opt, "--ro-exec") == 0) {
            need(argc, i, 1, opt);
            full(n_ro, opt);
            ro_exec[n_ro] = strcmp(opt, "--ro-exec") == 0;
            ro[n_ro++] = argv[++i];
        } else if (strcmp(opt, "--link") == 0) {
            need(argc, i, 2, opt);
            full(n_links, opt);
            links[n_links][0] = argv[++i];
            links[n_links++][1] = argv[++i];
        } else if (strcmp(opt, "--dev") == 0) {
            need(argc, i, 5, opt);
            full(n_devices, opt);
            struct device *d = &devices[n_devices++];
            d->path = argv[++i];
            d->major = (unsigned)number(argv[++i], "major");
            d->minor = (unsigned)number(argv[++i], "minor");
            d->mode = (unsigned)number(argv[++i], "mode");
            d->vmm_owned = (int)number(argv[++i], "owner");
        } else {
            errno = EINVAL;
            die("unknown option", opt);
        }
    }
    errno = EINVAL;
    die("no QEMU command after", "--");
    return -1;
}

/* root + absolute path; every path the plan names is absolute and normalised by the daemon */
static int normalised(const char *path) {
    if (path[0] != '/')
        return 0;
    for (const char *c = path; *c; ) {
        const char *next = strchr(c + 1, '/');
        size_t len = next ? (size_t)(next - c - 1) : strlen(c + 1);
        if ((len == 0 && next) || (len == 1 && c[1] == '.') || (len == 2 && c[1] == '.' && c[2] == '.'))
            return 0;
        if (!next)
            break;
        c = next;
    }
    return 1;
}

static char *inside(const char *path) {
    if (!normalised(path) || strcmp(path, "/") == 0) {
        errno = EINVAL;
        die("not a normalised absolute path", path);
    }
    char *out;
    if (asprintf(&out, "%s%s", root, path) < 0)
        die("asprintf", path);
    return out;
}

/* mkdir -p of the parents of ``full`` (inside the fresh tmpfs: only this process has written there) */
static void parents(char *full) {
    size_t skip = strlen(root);
    for (char *p = full + skip + 1; (p = strchr(p, '/')) != NULL; p++) {
        *p = '\0';
        if (mkdir(full, 0755) < 0 && errno != EEXIST)
            die("mkdir", full);
        *p = '/';
    }
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        die("open", path);
    ssize_t n = write(fd, text, strlen(text));
    if (n < 0 || (size_t)n != strlen(text))
        die("write", path);
    close(fd);
}

static void join_cgroups(void) {
    char pid[32];
    snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    for (int i = 0; i < n_cgroups; i++) {
        char *procs;
        if (asprintf(&procs, "%s/cgroup.procs", cgroups[i]) < 0)
            die("asprintf", cgroups[i]);
        write_file(procs, pid);
        free(procs);
    }
}

static void bind_ro(const char *path, int exec) {
    char *target = inside(path);
    struct stat st;
    if (stat(path, &st) < 0)
        die("stat", path);
    parents(target);
    if (S_ISDIR(st.st_mode)) {
        if (mkdir(target, 0755) < 0 && errno != EEXIST)
            die("mkdir", target);
    } else {
        int fd = open(target, O_WRONLY | O_CREAT | O_CLOEXEC, 0444);
        if (fd < 0)
            die("create", target);
        close(fd);
    }
    if (mount(path, target, NULL, MS_BIND, NULL) < 0)
        die("bind", path);
    unsigned long flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | (exec ? 0 : MS_NOEXEC);
    if (mount(NULL, target, NULL, flags, NULL) < 0)
        die("read-only remount", path);
    free(target);
}

static void make_link(const char *path, const char *to) {
    char *target = inside(path);
    parents(target);
    if (symlink(to, target) < 0)
        die("symlink", target);
    free(target);
}

static void make_device(const struct device *d) {
    char *target = inside(d->path);
    parents(target);
    if (mknod(target, S_IFCHR | 0600, makedev(d->major, d->minor)) < 0)
        die("mknod", target);
    /* only the VM's own devices (/dev/kvm) belong to its user; shared ones stay root's, world-usable */
    if (d->vmm_owned && chown(target, uid, gid) < 0)
        die("chown", target);
    if (chmod(target, d->mode & 07777) < 0)
        die("chmod", target);
    free(target);
}

static void build_root(void) {
    /* nothing done here may reach the host's mount table */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        die("make mounts private", "/");
    if (mount("dsec-vmm", root, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=1m,nr_inodes=4096") < 0)
        die("mount tmpfs on", root);
    for (int i = 0; i < n_ro; i++)
        bind_ro(ro[i], ro_exec[i]);
    for (int i = 0; i < n_links; i++)
        make_link(links[i][0], links[i][1]);
    for (int i = 0; i < n_devices; i++)
        make_device(&devices[i]);
    if (chdir(root) < 0)
        die("chdir", root);
    /* pivot_root(".", "."): the old root ends up stacked on the new one, and is then detached */
    if (syscall(SYS_pivot_root, ".", ".") < 0)
        die("pivot_root", root);
    if (umount2(".", MNT_DETACH) < 0)
        die("detach the old root", NULL);
    if (chdir("/") < 0)
        die("chdir", "/");
    if (mount(NULL, "/", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, NULL) < 0)
        die("read-only remount", "/");
}

static void drop_privileges(void) {
    /* the bounding set can only be emptied while CAP_SETPCAP is still held */
    for (int cap = 0; cap <= 63; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
            die("drop capability from the bounding set", NULL);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        die("clear ambient capabilities", NULL);
    if (setgroups(0, NULL) < 0)
        die("setgroups", NULL);
    if (setresgid(gid, gid, gid) < 0)
        die("setresgid", NULL);
    if (setresuid(uid, uid, uid) < 0)
        die("setresuid", NULL);
    /* leaving uid 0 empties permitted and effective; inheritable survives unless cleared */
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) < 0)
        die("capset", NULL);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        die("no_new_privs", NULL);
    uid_t r, e, s;
    if (getresuid(&r, &e, &s) < 0 || r != uid || e != uid || s != uid || getgid() != gid || getegid() != gid) {
        errno = EPERM;
        die("credentials did not change", NULL);
    }
    /* a core dump would be the guest's whole memory */
    struct rlimit none = {0, 0};
    if (setrlimit(RLIMIT_CORE, &none) < 0)
        die("setrlimit", "core");
}

/* Under TCG a guest's TSC is the host's, and the guest kernel's own calibration against the emulated
 * PIT fails when the host preempts QEMU mid-measurement (often, on a busy host): the guest then hangs
 * early in boot. Told the frequency (tsc_early_khz), it skips that calibration. Both clocks run
 * through preemption, so the measurement here does not suffer from it. */
static int print_tsc_khz(void) {
#if defined(__x86_64__)
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC_RAW, &a);
    unsigned long long t0 = __rdtsc(), t1;
    long long ns;
    do {
        clock_gettime(CLOCK_MONOTONIC_RAW, &b);
        t1 = __rdtsc();
        ns = (b.tv_sec - a.tv_sec) * 1000000000LL + (b.tv_nsec - a.tv_nsec);
    } while (ns < 100000000LL);
    printf("%llu\n", (unsigned long long)((t1 - t0) * 1000000.0 / (double)ns + 0.5));
    return 0;
#else
    return 1;
#endif
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--tsc-khz") == 0)
        return print_tsc_khz();
    int first = parse(argc, argv);
    if (root == NULL || uid == (uid_t)-1 || gid == (gid_t)-1 || uid == 0 || gid == 0) {
        errno = EINVAL;
        die("need --root and a non-root --uid and --gid", NULL);
    }
    umask(022);
    /* a session of its own: QEMU outlives the daemon, as containers do */
    if (setsid() < 0)
        die("setsid", NULL);
    join_cgroups();
    if (unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) < 0)
        die("unshare", NULL);
    build_root();
    /* after joining: the VMM sees its own cgroup as the root of the hierarchy */
    if (unshare(CLONE_NEWCGROUP) < 0)
        die("unshare", "cgroup");
    drop_privileges();
    execv(argv[first], &argv[first]);
    die("execv", argv[first]);
    return 127;
}
