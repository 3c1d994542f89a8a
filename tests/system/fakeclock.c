/*
 * fakeclock: an LD_PRELOAD shim that moves only a process's wall clock.
 *
 * The wall clock (CLOCK_REALTIME, CLOCK_REALTIME_COARSE, gettimeofday, time)
 * reads FAKECLOCK_OFFSET seconds ahead (negative: behind; fractions allowed).
 * Every other clock, CLOCK_MONOTONIC above all, is passed through untouched,
 * because timeouts and sleeps run on it and must keep working.
 *
 * We do not use libfaketime: Debian 12's build misbehaves with Python 3.11
 * (timed waits hang by the offset, time.sleep fails), see TESTING.md.
 *
 * Build: gcc -shared -fPIC -O2 -Wall -Wextra -o fakeclock.so fakeclock.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

#define NS_PER_S 1000000000LL

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static clock_gettime_fn real_clock_gettime;
static int64_t offset_ns;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init(void)
{
    /* RTLD_NEXT finds libc's own function, the one our definition hides. */
    real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    const char *text = getenv("FAKECLOCK_OFFSET");
    if (text != NULL) {
        double seconds = strtod(text, NULL);
        /* Round to the nearest nanosecond so "-0.5" is exactly half a second. */
        offset_ns = (int64_t)(seconds * 1e9 + (seconds < 0 ? -0.5 : 0.5));
    }
}

/* Reads the real clock and, for the wall clocks only, adds the offset. */
static int shifted_clock_gettime(clockid_t clock, struct timespec *ts)
{
    pthread_once(&init_once, init);
    int rc = real_clock_gettime(clock, ts);
    if (rc == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        int64_t ns = (int64_t)ts->tv_sec * NS_PER_S + ts->tv_nsec + offset_ns;
        /* Floor division keeps tv_nsec in [0, 1e9) for times moved before 1970 too. */
        int64_t sec = ns / NS_PER_S;
        int64_t rem = ns % NS_PER_S;
        if (rem < 0) {
            rem += NS_PER_S;
            sec -= 1;
        }
        ts->tv_sec = (time_t)sec;
        ts->tv_nsec = (long)rem;
    }
    return rc;
}

int clock_gettime(clockid_t clock, struct timespec *ts)
{
    return shifted_clock_gettime(clock, ts);
}

/* gettimeofday and time are built on the shifted clock_gettime, so all three agree. */
int gettimeofday(struct timeval *restrict tv, void *restrict tz)
{
    struct timespec ts;
    int rc = shifted_clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    /* The timezone argument is obsolete; Linux fills it with zeros. */
    if (tz != NULL) {
        struct timezone *zone = tz;
        zone->tz_minuteswest = 0;
        zone->tz_dsttime = 0;
    }
    return rc;
}

time_t time(time_t *tloc)
{
    struct timespec ts;
    if (shifted_clock_gettime(CLOCK_REALTIME, &ts) != 0) {
        return (time_t)-1;
    }
    if (tloc != NULL) {
        *tloc = ts.tv_sec;
    }
    return ts.tv_sec;
}
