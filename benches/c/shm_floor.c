/*
 * The hardware floor of a shared-memory ping-pong on this machine: two
 * processes pinned to cores 0 and 1, one shared buffer per direction and
 * one flag word per direction on its own cache line. Each half round trip
 * copies the message into the shared buffer, publishes it with a release
 * store of the flag, and the peer spins on the flag and copies it out.
 * No protocol, no allocation, no locks: what any copy-in/copy-out
 * transport (vader's fragments, our fast box and rings) can at best do.
 *
 *   cc -O2 -o shm_floor benches/c/shm_floor.c && ./shm_floor
 *
 * Prints "size=microseconds" per half round trip.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "probe.h"

struct flag {
    volatile uint64_t seq;
    char pad[56];
};

int main(void)
{
    const size_t sizes[] = {8, 1024, 2048, 4096, 8192, 16384, 32768};
    const int nsizes = sizeof sizes / sizeof sizes[0];
    const int iters = 100000, warmup = 1000;
    char *shm = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shm == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    struct flag *f = (struct flag *)shm; /* f[0]: to the child, f[1]: back */
    char *buf[2] = {shm + 4096, shm + 4096 + 65536};
    pid_t pid = fork();
    int me = pid == 0;
    pin(me);
    char *priv = calloc(1, 65536), *src = malloc(65536);
    memset(src, 1, 65536);
    uint64_t seq = 0;
    for (int s = 0; s < nsizes; s++) {
        size_t n = sizes[s];
        double t0 = 0;
        for (int i = 0; i < iters + warmup; i++) {
            if (i == warmup)
                t0 = now_us();
            seq++;
            if (!me) {
                memcpy(buf[0], src, n);
                __atomic_store_n(&f[0].seq, seq, __ATOMIC_RELEASE);
                while (__atomic_load_n(&f[1].seq, __ATOMIC_ACQUIRE) != seq)
                    ;
                memcpy(priv, buf[1], n);
            } else {
                while (__atomic_load_n(&f[0].seq, __ATOMIC_ACQUIRE) != seq)
                    ;
                memcpy(priv, buf[0], n);
                memcpy(buf[1], src, n);
                __atomic_store_n(&f[1].seq, seq, __ATOMIC_RELEASE);
            }
        }
        if (!me)
            printf("%zu=%.2f ", n, (now_us() - t0) / iters / 2);
    }
    if (!me) {
        printf("\n");
        wait(NULL);
    }
    return 0;
}
