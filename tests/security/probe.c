/* The suite's raw-syscall probe, built static on the host and uploaded into attacker sandboxes
 * (busybox images and VM guests have no compiler or python). Usage:
 *   probe NR ARG...     raw syscall(NR, args); ARG is an integer (0x.. ok), s:TEXT (a string),
 *                       b:N (N zeroed bytes), q:V,V,.. (an array of u64), f:PATH (an O_RDONLY fd),
 *                       w:PATH (an O_RDWR fd)
 *   probe id            print the real and effective uid
 * Prints "ret=R errno=E" so the test reads the kernel's own answer, not a libc wrapper's. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static long arg(const char *a) {
    if (!strncmp(a, "s:", 2)) return (long)(a + 2);
    if (!strncmp(a, "b:", 2)) return (long)calloc(1, strtoul(a + 2, 0, 0) + 1);
    if (!strncmp(a, "f:", 2)) return open(a + 2, O_RDONLY);
    if (!strncmp(a, "w:", 2)) return open(a + 2, O_RDWR);
    if (!strncmp(a, "q:", 2)) {
        unsigned long long *v = calloc(32, sizeof *v);
        char *s = strdup(a + 2), *tok, *save = 0;
        int i = 0;
        for (tok = strtok_r(s, ",", &save); tok && i < 32; tok = strtok_r(0, ",", &save))
            v[i++] = strtoull(tok, 0, 0);
        return (long)v;
    }
    return (long)strtoull(a, 0, 0);
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "id")) {
        printf("uid=%d euid=%d\n", getuid(), geteuid());
        return 0;
    }
    if (argc < 2 || argc > 8) {
        fprintf(stderr, "usage: probe NR [ARG...]\n");
        return 2;
    }
    long a[6] = {0};
    for (int i = 2; i < argc; i++) a[i - 2] = arg(argv[i]);
    pid_t self = getpid();
    errno = 0;
    long r = syscall(strtol(argv[1], 0, 0), a[0], a[1], a[2], a[3], a[4], a[5]);
    int e = errno;
    /* a clone that succeeded: the child leaves at once, the parent reports */
    if (r == 0 && syscall(SYS_getpid) != self) _exit(0);
    printf("ret=%ld errno=%d\n", r, e);
    fflush(stdout);
    return 0;
}
