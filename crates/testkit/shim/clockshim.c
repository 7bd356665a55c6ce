/*
 * tollgate clock shim: an LD_PRELOAD library that moves a process's wall clock
 * (CLOCK_REALTIME) under test control, so Redis's TIME, TIME inside scripts and key
 * expiry follow a clock the test sets. Monotonic clocks are untouched, so Redis's event
 * loop and timers keep running normally.
 *
 * Control file: path in env TOLLGATE_CLOCK_FILE, re-read on every call. One line:
 *   +N   real time plus N nanoseconds
 *   -N   real time minus N nanoseconds
 *   =N   frozen at N nanoseconds since the Unix epoch
 *   empty, missing or unparsable: real time
 *
 * Rules that keep it safe inside redis-server (jemalloc, threads): no malloc, no stdio,
 * no dlsym, no libc time functions (the kernel is called through syscall(), so nothing
 * recurses), errno is preserved, and the file path is captured once by a constructor
 * before any thread exists. The test writes the file atomically (temp file + rename),
 * so a reader sees the old line or the new one, never half of one.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define NSEC_PER_SEC 1000000000LL
#define PATH_CAP 4096

static char control_path[PATH_CAP];
static int control_path_set;

__attribute__((constructor)) static void clockshim_init(void) {
    const char *p = getenv("TOLLGATE_CLOCK_FILE");
    size_t i = 0;
    if (p == NULL || p[0] == '\0') {
        return;
    }
    while (p[i] != '\0' && i + 1 < PATH_CAP) {
        control_path[i] = p[i];
        i++;
    }
    if (p[i] != '\0') {
        return; /* path too long: behave as real time rather than open a truncated path */
    }
    control_path[i] = '\0';
    control_path_set = 1;
}

enum mode { MODE_REAL, MODE_OFFSET, MODE_FROZEN };

/* Reads the control file; on success sets *value (offset or absolute ns). */
static enum mode read_control(long long *value) {
    char buf[64];
    long n, fd;
    int i = 0, negative = 0;
    char op;
    long long v = 0;

    if (!control_path_set) {
        return MODE_REAL;
    }
    fd = syscall(SYS_openat, AT_FDCWD, control_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return MODE_REAL;
    }
    n = syscall(SYS_read, (int)fd, buf, sizeof(buf) - 1);
    syscall(SYS_close, (int)fd);
    if (n <= 0) {
        return MODE_REAL;
    }
    buf[n] = '\0';

    while (buf[i] == ' ' || buf[i] == '\t') {
        i++;
    }
    op = buf[i++];
    if (op != '+' && op != '-' && op != '=') {
        return MODE_REAL;
    }
    negative = (op == '-');
    if (buf[i] < '0' || buf[i] > '9') {
        return MODE_REAL;
    }
    while (buf[i] >= '0' && buf[i] <= '9') {
        if (v > (9223372036854775807LL - 9) / 10) {
            return MODE_REAL; /* overflow: refuse rather than wrap */
        }
        v = v * 10 + (buf[i] - '0');
        i++;
    }
    *value = negative ? -v : v;
    return op == '=' ? MODE_FROZEN : MODE_OFFSET;
}

/* Shifted wall-clock time for a REALTIME-family clock; returns the syscall's result. */
static int shifted_realtime(clockid_t clk, struct timespec *ts) {
    long long value = 0, sec, nsec;
    long rc;
    enum mode m = read_control(&value);

    if (m == MODE_FROZEN) {
        ts->tv_sec = (time_t)(value / NSEC_PER_SEC);
        ts->tv_nsec = (long)(value % NSEC_PER_SEC);
        return 0;
    }
    rc = syscall(SYS_clock_gettime, clk, ts);
    if (rc != 0 || m == MODE_REAL) {
        return (int)rc;
    }
    sec = (long long)ts->tv_sec + value / NSEC_PER_SEC;
    nsec = (long long)ts->tv_nsec + value % NSEC_PER_SEC;
    if (nsec < 0) {
        nsec += NSEC_PER_SEC;
        sec -= 1;
    } else if (nsec >= NSEC_PER_SEC) {
        nsec -= NSEC_PER_SEC;
        sec += 1;
    }
    if (sec < 0) {
        sec = 0;
        nsec = 0;
    }
    ts->tv_sec = (time_t)sec;
    ts->tv_nsec = (long)nsec;
    return 0;
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    int saved = errno, rc;
    if (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE) {
        rc = shifted_realtime(clk, ts);
        if (rc == 0) {
            errno = saved;
        }
        return rc;
    }
    return (int)syscall(SYS_clock_gettime, clk, ts);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnonnull-compare"
int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec ts;
    int saved = errno;
    if (tz != NULL) {
        struct timezone *z = (struct timezone *)tz;
        z->tz_minuteswest = 0;
        z->tz_dsttime = 0;
    }
    if (tv == NULL) {
        return 0;
    }
    if (shifted_realtime(CLOCK_REALTIME, &ts) != 0) {
        return -1;
    }
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = (suseconds_t)(ts.tv_nsec / 1000);
    errno = saved;
    return 0;
}
#pragma GCC diagnostic pop

time_t time(time_t *out) {
    struct timespec ts;
    int saved = errno;
    if (shifted_realtime(CLOCK_REALTIME, &ts) != 0) {
        return (time_t)-1;
    }
    errno = saved;
    if (out != NULL) {
        *out = ts.tv_sec;
    }
    return ts.tv_sec;
}

int timespec_get(struct timespec *ts, int base) {
    int saved = errno;
    if (base != TIME_UTC || shifted_realtime(CLOCK_REALTIME, ts) != 0) {
        return 0;
    }
    errno = saved;
    return base;
}
