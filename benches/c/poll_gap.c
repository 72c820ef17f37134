/*
 * How the spacing of a waiter's loads changes a one-line ping-pong.
 *
 * Two processes pinned to cores 0 and 1 bounce a message that fills one
 * 64-byte slot, written the way async-btl's fast box writes it: three
 * payload words, then the mark word last with a release store. The
 * slots advance round a 32 KiB ring, so every message lands on a line the
 * other side last read (its writer must first take it back). The waiter
 * spins on the mark, doing GAP dependent increments between two loads.
 *
 *   cc -O2 -o poll_gap benches/c/poll_gap.c && ./poll_gap 0 3 10 30
 *
 * Prints "gap=G ns=N" per argument, N being the half round trip. A gap
 * of 2-5 increments can beat a bare spin by 1.7x (where a line exchange
 * takes about 35 ns) to 2.5x (about 150 ns); a gap of 30 loses again. A waiter that loads the
 * watched line back to back slows the very write it waits for.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "probe.h"

#define SLOTS 512

struct slot {
    volatile uint64_t w[8];
};

static volatile uint64_t spacer;

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static void wait_for(struct slot *in, uint64_t seq, int gap)
{
    while (__atomic_load_n(&in->w[0], __ATOMIC_ACQUIRE) != seq)
        for (int i = 0; i < gap; i++)
            spacer++;
}

static void post(struct slot *out, uint64_t seq)
{
    out->w[1] = seq;
    out->w[2] = 8;
    out->w[3] = seq;
    __atomic_store_n(&out->w[0], seq, __ATOMIC_RELEASE);
}

static void run(int gap, struct slot *s, int me)
{
    const uint64_t iters = 200000, warmup = 2000;
    double t0 = 0;
    for (uint64_t i = 1; i <= iters + warmup; i++) {
        if (i == warmup + 1)
            t0 = now_ns();
        struct slot *out = &s[(i * 2 + me) % SLOTS], *in = &s[(i * 2 + !me) % SLOTS];
        if (!me) {
            post(out, i);
            wait_for(in, i, gap);
        } else {
            wait_for(in, i, gap);
            post(out, i);
        }
    }
    if (!me)
        printf("gap=%d ns=%.1f\n", gap, (now_ns() - t0) / iters / 2);
}

int main(int argc, char **argv)
{
    for (int a = 1; a < argc; a++) {
        struct slot *s = mmap(NULL, SLOTS * sizeof(struct slot), PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (s == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        fflush(stdout);
        pid_t pid = fork();
        int me = pid == 0;
        pin(me);
        run(atoi(argv[a]), s, me);
        if (me)
            _exit(0);
        wait(NULL);
        munmap(s, SLOTS * sizeof(struct slot));
    }
    return 0;
}
