/*
 * The two helpers every C probe in this folder uses: a monotonic clock in
 * microseconds and pinning the calling process to one core. Header-only,
 * so each probe still builds with one `cc` command.
 */
#ifndef ASYNC_BTL_PROBE_H
#define ASYNC_BTL_PROBE_H

#include <sched.h>
#include <time.h>

static inline double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static inline void pin(int core)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    sched_setaffinity(0, sizeof set, &set);
}

#endif
