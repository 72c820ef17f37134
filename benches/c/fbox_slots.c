/*
 * What a second cache line costs a fast-box ping-pong on this machine.
 * Two processes pinned to cores 0 and 1, one box of 256 64-byte slots per
 * direction, laid out as `src/sm/fbox.rs` lays out its box: a message of k
 * slots writes slots n+1..n+k-1 first, then slot n, whose first word (the
 * head mark) is stored last with release; the peer spins on that word,
 * reads the k slots and replies the same way. Slot numbers advance, so the
 * box is walked around as ours is.
 *
 *   cc -O2 -o fbox_slots benches/c/fbox_slots.c && ./fbox_slots [MODE]
 *
 * MODE 0: the receiver spins on the head word only (as `sm` does);
 *      1: it also prefetches slot n+1 on each turn of the spin;
 *      2: the sender prefetches the next message's slots for writing;
 *      3: the receiver also loads slot n+1's first word on each turn.
 *
 * Prints "k=slots microseconds" per half round trip for k = 1..4.
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

#define SLOTS 256

struct slot {
    volatile uint64_t w[8];
};

struct box {
    struct slot s[SLOTS];
};

static int mode;

static uint64_t head_mark(uint64_t n)
{
    return (n + 1) << 8 | 1;
}

static void put_msg(struct box *b, uint64_t *n, int k)
{
    for (int i = k - 1; i >= 1; i--) {
        struct slot *s = &b->s[(*n + i) % SLOTS];
        for (int w = 1; w < 8; w++)
            s->w[w] = *n;
        s->w[0] = *n;
    }
    struct slot *h = &b->s[*n % SLOTS];
    h->w[1] = 1;
    h->w[2] = (uint64_t)k;
    for (int w = 3; w < 8; w++)
        h->w[w] = *n;
    __atomic_store_n(&h->w[0], head_mark(*n), __ATOMIC_RELEASE);
    *n += (uint64_t)k;
    if (mode == 2)
        for (int i = 1; i <= k; i++)
            __builtin_prefetch((void *)&b->s[(*n + i) % SLOTS], 1, 3);
}

static uint64_t take_msg(struct box *b, uint64_t *n)
{
    struct slot *h = &b->s[*n % SLOTS];
    volatile uint64_t *next = &b->s[(*n + 1) % SLOTS].w[0];
    while (__atomic_load_n(&h->w[0], __ATOMIC_ACQUIRE) != head_mark(*n)) {
        if (mode == 1)
            __builtin_prefetch((void *)next, 0, 3);
        else if (mode == 3)
            (void)*next;
    }
    uint64_t sum = 0;
    int k = (int)h->w[2];
    for (int i = 0; i < k; i++)
        for (int w = 1; w < 8; w++)
            sum += b->s[(*n + i) % SLOTS].w[w];
    *n += (uint64_t)k;
    return sum;
}

int main(int argc, char **argv)
{
    const int iters = 200000, warm = 1000;
    mode = argc > 1 ? atoi(argv[1]) : 0;
    struct box *m = mmap(NULL, 2 * sizeof(struct box), PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    for (int k = 1; k <= 4; k++) {
        for (size_t i = 0; i < 2 * sizeof(struct box) / 8; i++)
            ((volatile uint64_t *)m)[i] = 0;
        pid_t child = fork();
        if (child < 0) {
            perror("fork");
            return 1;
        }
        if (child == 0) {
            pin(1);
            uint64_t in = 0, out = 0;
            for (int i = 0; i < iters; i++) {
                take_msg(&m[0], &in);
                put_msg(&m[1], &out, k);
            }
            _exit(0);
        }
        pin(0);
        uint64_t in = 0, out = 0;
        double t0 = 0;
        for (int i = 0; i < iters; i++) {
            if (i == warm)
                t0 = now_us();
            put_msg(&m[0], &out, k);
            take_msg(&m[1], &in);
        }
        double t = (now_us() - t0) / (iters - warm) / 2;
        waitpid(child, NULL, 0);
        printf("k=%d %.3f  ", k, t);
    }
    printf("\n");
    return 0;
}
