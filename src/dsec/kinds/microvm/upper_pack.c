/*
 * pack-upper: a microvm guest's overlayfs upper directory as an OCI image layer tar, for pack_diff.
 *
 * The guest has neither Python nor a tar that reads xattrs, and overlayfs records deletions in ways an
 * OCI layer spells differently, so this walks the directory itself and writes the layer to stdout:
 *   a 0:0 character device NAME (or a file with trusted.overlay.whiteout)  ->  empty file  .wh.NAME
 *   a directory with trusted.overlay.opaque=y                             ->  DIR/ then DIR/.wh..wh..opq
 * Names are "./" (the directory itself, whose attributes become the layer root's), "./a", "./a/b/"
 * with "/" after directories. Members come in a fixed order (bytewise sorted, each directory followed by
 * its contents), owners are numeric only and times whole seconds, so the same tree gives the same bytes.
 * Ustar headers, with a PAX header before a member whose path, link target, owner, size or mtime does
 * not fit, or that carries xattrs worth keeping (user.*, file capabilities, ACLs: overlayfs's own are
 * the layer format's business, not the files').
 *
 * Sockets, device nodes, other mounts and names starting with ".wh." cannot go into a layer: they are
 * left out and named on stderr. Status 1 means the archive on stdout is unusable (I/O error; or a
 * redirect_dir / metacopy upper, whose changes are not all in the directory); 2 is a usage error.
 *
 *   pack-upper [--exclude PATH]... DIR    (PATH relative to DIR; excluding a directory drops its subtree)
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#define BLOCK 512
#define MAX_OCT7 07777777ull        /* largest value in a ustar uid/gid field */
#define MAX_OCT11 077777777777ull   /* ... and in its size/mtime fields */
#define OUT_SIZE (256u << 10)
#define WHITEOUT ".wh."
#define OPAQUE_MARKER ".wh..wh..opq"

struct buf {
    char *data;
    size_t len, cap;
};

struct link {
    ino_t ino;
    char *name; /* NULL: free slot */
};

static dev_t root_dev;
static char **excludes;
static int nexcludes;
static struct buf path; /* the current entry's member name without a directory's trailing "/" */
static struct buf pax;  /* records for the next member's PAX header */
static struct link *links;
static size_t nlinks, links_cap;
static char out[OUT_SIZE];
static size_t out_len;
static const char zeros[BLOCK];

static void vsay(const char *fmt, va_list ap) {
    fputs("pack-upper: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
}

static __attribute__((format(printf, 1, 2))) void note(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsay(fmt, ap);
    va_end(ap);
}

static __attribute__((noreturn, format(printf, 1, 2))) void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsay(fmt, ap);
    va_end(ap);
    exit(1);
}

static void usage(FILE *f, int status) {
    fputs("usage: pack-upper [--exclude PATH]... DIR\n"
          "writes DIR (an overlayfs upper directory) to stdout as an OCI image layer tar\n",
          f);
    exit(status);
}

static void *xrealloc(void *p, size_t n) {
    p = realloc(p, n);
    if (!p) die("out of memory");
    return p;
}

static void buf_add(struct buf *b, const void *p, size_t n) {
    if (b->len + n + 1 > b->cap) {
        while (b->len + n + 1 > b->cap) b->cap = b->cap ? b->cap * 2 : 256;
        b->data = xrealloc(b->data, b->cap);
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0'; /* kept terminated: path is used as a C string */
}

static void buf_str(struct buf *b, const char *s) { buf_add(b, s, strlen(s)); }

static void buf_cut(struct buf *b, size_t len) {
    b->len = len;
    if (b->data) b->data[len] = '\0';
}

/* ---- output ------------------------------------------------------------------------------------- */

static void flush_out(void) {
    size_t off = 0;
    while (off < out_len) {
        ssize_t n = write(1, out + off, out_len - off);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) die("writing the archive: %s", n < 0 ? strerror(errno) : "short write");
        off += (size_t)n;
    }
    out_len = 0;
}

static void put(const void *p, size_t n) {
    while (n) {
        if (out_len == OUT_SIZE) flush_out();
        size_t k = OUT_SIZE - out_len < n ? OUT_SIZE - out_len : n;
        memcpy(out + out_len, p, k);
        out_len += k;
        p = (const char *)p + k;
        n -= k;
    }
}

static void put_zeros(uint64_t n) {
    while (n) {
        size_t k = n < BLOCK ? (size_t)n : BLOCK;
        put(zeros, k);
        n -= k;
    }
}

static void pad(uint64_t size) { put_zeros((BLOCK - size % BLOCK) % BLOCK); }

/* ---- headers ------------------------------------------------------------------------------------ */

static void octal(char *field, int width, uint64_t v) {
    snprintf(field, (size_t)width, "%0*llo", width - 1, (unsigned long long)v);
}

static void ustar(const char *name, char type, unsigned mode, uint64_t uid, uint64_t gid, uint64_t size,
                  uint64_t mtime, const char *link) {
    char h[BLOCK];
    memset(h, 0, sizeof h);
    /* a name that does not fit is in the PAX header; the truncated copy only serves PAX-blind readers */
    size_t n = strlen(name);
    memcpy(h, name, n < 100 ? n : 100);
    octal(h + 100, 8, mode);
    octal(h + 108, 8, uid);
    octal(h + 116, 8, gid);
    octal(h + 124, 12, size);
    octal(h + 136, 12, mtime);
    h[156] = type;
    if (link) {
        n = strlen(link);
        memcpy(h + 157, link, n < 100 ? n : 100);
    }
    memcpy(h + 257, "ustar", 6);
    memcpy(h + 263, "00", 2);
    octal(h + 329, 8, 0);
    octal(h + 337, 8, 0);
    memset(h + 148, ' ', 8);
    unsigned sum = 0;
    for (int i = 0; i < BLOCK; i++) sum += (unsigned char)h[i];
    snprintf(h + 148, 7, "%06o", sum);
    put(h, sizeof h);
}

static void pax_add(const char *key, const char *val, size_t vlen) {
    /* a record's length counts its own digits */
    size_t base = strlen(key) + vlen + 3, len = base + 1;
    for (;;) {
        char d[24];
        size_t want = base + (size_t)snprintf(d, sizeof d, "%zu", len);
        if (want == len) break;
        len = want;
    }
    char head[32];
    snprintf(head, sizeof head, "%zu ", len);
    buf_str(&pax, head);
    buf_str(&pax, key);
    buf_add(&pax, "=", 1);
    buf_add(&pax, val, vlen);
    buf_add(&pax, "\n", 1);
}

static void pax_num(const char *key, long long v) {
    char s[24];
    pax_add(key, s, (size_t)snprintf(s, sizeof s, "%lld", v));
}

/* One member, after the PAX records collected for it (xattrs) and those its fields need. */
static void member(const char *name, char type, const struct stat *st, unsigned mode, uint64_t size,
                   const char *link) {
    uint64_t uid = st->st_uid, gid = st->st_gid;
    long long mtime = (long long)st->st_mtime;
    if (strlen(name) > 100) pax_add("path", name, strlen(name));
    if (link && strlen(link) > 100) pax_add("linkpath", link, strlen(link));
    if (uid > MAX_OCT7) pax_num("uid", (long long)uid);
    if (gid > MAX_OCT7) pax_num("gid", (long long)gid);
    if (size > MAX_OCT11) pax_num("size", (long long)size);
    int mtime_fits = mtime >= 0 && (unsigned long long)mtime <= MAX_OCT11;
    if (!mtime_fits) pax_num("mtime", mtime);
    if (pax.len) {
        ustar("././@PaxHeader", 'x', 0644, 0, 0, pax.len, 0, NULL);
        put(pax.data, pax.len);
        pad(pax.len);
        buf_cut(&pax, 0);
    }
    ustar(name, type, mode, uid > MAX_OCT7 ? 0 : uid, gid > MAX_OCT7 ? 0 : gid, size > MAX_OCT11 ? 0 : size,
          mtime_fits ? (uint64_t)mtime : 0, link);
}

/* ---- xattrs ------------------------------------------------------------------------------------- */

static ssize_t get_xattr(int fd, const char *name, char *val, size_t size) {
    ssize_t n = fgetxattr(fd, name, val, size);
    if (n < 0 && errno != ENODATA && errno != ENOTSUP && errno != ERANGE)
        die("%s: reading xattr %s: %s", path.data, name, strerror(errno));
    return n < 0 && errno == ERANGE ? (ssize_t)size + 1 : n;
}

static int xattr_is(int fd, const char *name, char value) {
    char v[2];
    return get_xattr(fd, name, v, sizeof v) == 1 && v[0] == value;
}

static int kept_xattr(const char *k) {
    if (strncmp(k, "user.", 5) == 0) return strncmp(k, "user.overlay.", 13) != 0;
    return strcmp(k, "security.capability") == 0 || strcmp(k, "system.posix_acl_access") == 0 ||
           strcmp(k, "system.posix_acl_default") == 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void add_xattrs(int fd) {
    static char list[XATTR_LIST_MAX], val[XATTR_SIZE_MAX]; /* the kernel's own limits: one call each */
    ssize_t n = flistxattr(fd, list, sizeof list);
    if (n < 0 && errno != ENOTSUP) die("%s: listing xattrs: %s", path.data, strerror(errno));
    char **keys = NULL;
    size_t nkeys = 0;
    for (ssize_t i = 0; i < n; i += (ssize_t)strlen(list + i) + 1)
        if (kept_xattr(list + i)) {
            keys = xrealloc(keys, (nkeys + 1) * sizeof *keys);
            keys[nkeys++] = list + i;
        }
    qsort(keys, nkeys, sizeof *keys, cmp_str); /* listing order is the filesystem's, not ours to leak */
    for (size_t i = 0; i < nkeys; i++) {
        ssize_t vlen = fgetxattr(fd, keys[i], val, sizeof val);
        if (vlen < 0 && errno == ENODATA) continue;
        if (vlen < 0) die("%s: reading xattr %s: %s", path.data, keys[i], strerror(errno));
        char key[XATTR_NAME_MAX + 16];
        snprintf(key, sizeof key, "SCHILY.xattr.%s", keys[i]);
        pax_add(key, val, (size_t)vlen);
    }
    free(keys);
}

/* ---- hard links --------------------------------------------------------------------------------- */

static size_t link_slot(ino_t ino) {
    size_t i = (size_t)((uint64_t)ino * 0x9E3779B97F4A7C15ull >> 20) & (links_cap - 1);
    while (links[i].name && links[i].ino != ino) i = (i + 1) & (links_cap - 1);
    return i;
}

/* The member name of the first file seen with this inode; NULL, and remembers `name`, if this is it. */
static const char *link_seen(ino_t ino, const char *name) {
    if (2 * (nlinks + 1) > links_cap) { /* half full at most, so probe chains stay short */
        struct link *old = links;
        size_t old_cap = links_cap;
        links_cap = links_cap ? links_cap * 2 : 256;
        if (!(links = calloc(links_cap, sizeof *links))) die("out of memory");
        for (size_t i = 0; i < old_cap; i++)
            if (old[i].name) links[link_slot(old[i].ino)] = old[i];
        free(old);
    }
    struct link *l = &links[link_slot(ino)];
    if (l->name) return l->name;
    l->ino = ino;
    if (!(l->name = strdup(name))) die("out of memory");
    nlinks++;
    return NULL;
}

/* ---- the walk ----------------------------------------------------------------------------------- */

static void whiteout(size_t parent_len, const char *name, const struct stat *st) {
    struct buf w = {0};
    buf_add(&w, path.data, parent_len);
    buf_str(&w, "/" WHITEOUT);
    buf_str(&w, name);
    member(w.data, '0', st, 0, 0, NULL);
    free(w.data);
}

/* What was lstat'ed as `want`, opened; or -1 (noted) when it has gone or been replaced since. */
static int reopen(int dfd, const char *name, int flags, const struct stat *want, struct stat *st) {
    int fd = openat(dfd, name, flags | O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno != ENOENT && errno != ELOOP && errno != ENOTDIR) die("%s: %s", path.data, strerror(errno));
    if (fd >= 0 && fstat(fd, st) < 0) die("%s: %s", path.data, strerror(errno));
    if (fd >= 0 && st->st_ino == want->st_ino && st->st_dev == want->st_dev) return fd;
    note("skipped %s: removed or replaced while packing", path.data);
    if (fd >= 0) close(fd);
    return -1;
}

static void regular(int dfd, const char *name, size_t parent_len, const struct stat *lst) {
    struct stat st;
    /* O_NONBLOCK: should a fifo have taken the file's place, the open must not wait for a writer */
    int fd = reopen(dfd, name, O_NOCTTY | O_NONBLOCK, lst, &st);
    if (fd < 0) return;
    char v[1];
    if (get_xattr(fd, "trusted.overlay.whiteout", v, sizeof v) >= 0) {
        close(fd);
        whiteout(parent_len, name, &st);
        return;
    }
    if (get_xattr(fd, "trusted.overlay.metacopy", v, sizeof v) >= 0)
        die("%s: a metacopy-only copy-up (its data is in a lower layer): mount with metacopy=off", path.data);
    if (st.st_nlink > 1) {
        const char *first = link_seen(st.st_ino, path.data);
        if (first) {
            close(fd);
            member(path.data, '1', &st, st.st_mode & 07777, 0, first);
            return;
        }
    }
    add_xattrs(fd);
    uint64_t size = (uint64_t)st.st_size, left = size;
    member(path.data, '0', &st, st.st_mode & 07777, size, NULL);
    while (left) { /* straight into the output buffer: file data is most of the archive */
        if (out_len == OUT_SIZE) flush_out();
        size_t want = OUT_SIZE - out_len < left ? OUT_SIZE - out_len : (size_t)left;
        ssize_t n = read(fd, out + out_len, want);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) die("%s: %s", path.data, strerror(errno));
        if (n == 0) { /* the header is out already: the member keeps its size */
            note("%s shrank while packing: padded with zeros to %llu bytes", path.data, (unsigned long long)size);
            put_zeros(left);
            break;
        }
        out_len += (size_t)n;
        left -= (uint64_t)n;
    }
    pad(size);
    if (!left && fstat(fd, &st) == 0 && (uint64_t)st.st_size > size)
        note("%s grew while packing: cut to %llu bytes", path.data, (unsigned long long)size);
    close(fd);
}

static int excluded(void) {
    for (int i = 0; i < nexcludes; i++)
        if (strcmp(path.data + 2, excludes[i]) == 0) return 1;
    return 0;
}

static void directory(int fd, const struct stat *st);

static void entry(int dfd, const char *name) {
    size_t parent_len = path.len;
    buf_add(&path, "/", 1);
    buf_str(&path, name);
    struct stat st;
    if (excluded()) goto done;
    if (strncmp(name, WHITEOUT, strlen(WHITEOUT)) == 0) {
        note("skipped %s: OCI layers reserve names starting with " WHITEOUT, path.data);
        goto done;
    }
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
        if (errno != ENOENT) die("%s: %s", path.data, strerror(errno));
        note("skipped %s: removed while packing", path.data);
        goto done;
    }
    if (st.st_dev != root_dev) {
        note("skipped %s: another filesystem is mounted there", path.data);
        goto done;
    }
    unsigned mode = st.st_mode & 07777;
    if (S_ISREG(st.st_mode)) {
        regular(dfd, name, parent_len, &st);
    } else if (S_ISDIR(st.st_mode)) {
        struct stat fst;
        int fd = reopen(dfd, name, O_DIRECTORY, &st, &fst);
        if (fd >= 0) directory(fd, &fst);
    } else if (S_ISLNK(st.st_mode)) {
        char target[PATH_MAX + 1];
        ssize_t n = readlinkat(dfd, name, target, sizeof target);
        if (n >= (ssize_t)sizeof target) die("%s: symlink target too long", path.data);
        if (n >= 0) {
            target[n] = '\0';
            member(path.data, '2', &st, mode, 0, target);
        } else if (errno == ENOENT || errno == EINVAL) {
            note("skipped %s: removed or replaced while packing", path.data);
        } else {
            die("%s: %s", path.data, strerror(errno));
        }
    } else if (S_ISFIFO(st.st_mode)) {
        member(path.data, '6', &st, mode, 0, NULL);
    } else if (S_ISCHR(st.st_mode) && st.st_rdev == 0) {
        whiteout(parent_len, name, &st);
    } else if (S_ISSOCK(st.st_mode)) {
        note("skipped %s: a socket", path.data);
    } else {
        note("skipped %s: %s device %u:%u", path.data, S_ISCHR(st.st_mode) ? "character" : "block",
             major(st.st_rdev), minor(st.st_rdev));
    }
done:
    buf_cut(&path, parent_len);
}

/* Emits the directory open as fd (path names it), then its contents; closes fd. */
static void directory(int fd, const struct stat *st) {
    char v[1];
    if (get_xattr(fd, "trusted.overlay.redirect", v, sizeof v) >= 0)
        die("%s: a renamed lower directory (its contents are in a lower layer): mount with redirect_dir=off",
            path.data);
    int opaque = xattr_is(fd, "trusted.overlay.opaque", 'y');
    size_t len = path.len;
    add_xattrs(fd);
    buf_add(&path, "/", 1);
    member(path.data, '5', st, st->st_mode & 07777, 0, NULL);
    if (opaque) {
        buf_str(&path, OPAQUE_MARKER);
        member(path.data, '0', st, 0, 0, NULL);
    }
    buf_cut(&path, len);

    DIR *d = fdopendir(fd);
    if (!d) die("%s: %s", path.data, strerror(errno));
    char **names = NULL;
    size_t n = 0;
    struct dirent *de;
    for (errno = 0; (de = readdir(d)); errno = 0) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        names = xrealloc(names, (n + 1) * sizeof *names);
        if (!(names[n++] = strdup(de->d_name))) die("out of memory");
    }
    if (errno) die("%s: reading the directory: %s", path.data, strerror(errno));
    qsort(names, n, sizeof *names, cmp_str); /* bytewise, whatever the locale: the same tree, the same tar */
    for (size_t i = 0; i < n; i++) {
        entry(dirfd(d), names[i]);
        free(names[i]);
    }
    free(names);
    closedir(d);
}

static char *normalize_exclude(char *p) {
    for (;;) {
        if (p[0] == '/') p++;
        else if (p[0] == '.' && p[1] == '/') p += 2;
        else break;
    }
    size_t n = strlen(p);
    while (n && p[n - 1] == '/') p[--n] = '\0';
    if (!n || strcmp(p, ".") == 0) {
        fputs("pack-upper: --exclude needs a path inside DIR\n", stderr);
        usage(stderr, 2);
    }
    return p;
}

int main(int argc, char **argv) {
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) usage(stdout, 0);
        char *value = NULL;
        if (strcmp(a, "--exclude") == 0 && i + 1 < argc) value = argv[++i];
        else if (strncmp(a, "--exclude=", 10) == 0) value = argv[i] + 10;
        else usage(stderr, 2);
        excludes = xrealloc(excludes, (size_t)(nexcludes + 1) * sizeof *excludes);
        excludes[nexcludes++] = normalize_exclude(value);
    }
    if (argc - i != 1) usage(stderr, 2);
    const char *dir = argv[i];

    signal(SIGPIPE, SIG_IGN); /* a reader going away is an error to report, not a silent death */
    struct rlimit rl; /* one descriptor per directory level stays open */
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) die("%s: %s", dir, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0) die("%s: %s", dir, strerror(errno));
    root_dev = st.st_dev;
    buf_str(&path, ".");
    directory(fd, &st);
    put_zeros(2 * BLOCK);
    flush_out();
    return 0;
}
