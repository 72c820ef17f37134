/*
 * copy_clock: what a bulk copy routine does to its own speed over time.
 *
 * Copies SIZE bytes (default 128 KiB, both buffers page-aligned and small
 * enough to stay in the L2 cache) again and again, for MS milliseconds per
 * phase, and prints GB/s for every run of 32 copies, so that a change of
 * clock shows as a step in the series. The phases alternate: libc's
 * memcpy, the AVX2 loop that `src/sys/mem/copy.rs` uses, libc, AVX2. On a
 * CPU that lowers its clock under sustained `rep movsb` (glibc's memcpy at
 * this size), memcpy runs fast for a few ms, then about 0.85x as fast; the
 * AVX2 loop that follows begins slower still and climbs back to about 0.95x
 * memcpy's first rate over several ms, and never drops.
 *
 *   cc -O2 -o /tmp/copy_clock benches/c/copy_clock.c
 *   /tmp/copy_clock [CORE [SIZE [MS]]]
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probe.h"

__attribute__((target("avx2"))) static void *copy_avx2(void *dst, const void *src, size_t n)
{
    char *d = dst;
    const char *s = src;
    size_t i = 0;
    /* Both buffers are page-aligned here, so the stores are aligned. */
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_store_si256((__m256i *)(d + i), a);
        _mm256_store_si256((__m256i *)(d + i + 32), b);
        _mm256_store_si256((__m256i *)(d + i + 64), c);
        _mm256_store_si256((__m256i *)(d + i + 96), e);
    }
    memcpy(d + i, s + i, n - i);
    return dst;
}

int main(int argc, char **argv)
{
    int core = argc > 1 ? atoi(argv[1]) : 0;
    size_t n = argc > 2 ? (size_t)atol(argv[2]) : 128 * 1024;
    double ms = argc > 3 ? atof(argv[3]) : 8.0;
    n = (n + 127) / 128 * 128;
    pin(core);
    char *src = aligned_alloc(4096, n), *dst = aligned_alloc(4096, n);
    if (!src || !dst) {
        fprintf(stderr, "copy_clock: out of memory\n");
        return 1;
    }
    memset(src, 1, n);
    memset(dst, 2, n);
    void *(*routine[2])(void *, const void *, size_t) = {memcpy, copy_avx2};
    const char *name[2] = {"memcpy", "avx2"};
    printf("# GB/s per 32 copies of %zu B on core %d, %.1f ms per phase\n", n, core, ms);
    for (int phase = 0; phase < 4; phase++) {
        int k = phase % 2;
        printf("%-6s:", name[k]);
        double start = now_us();
        while (now_us() - start < ms * 1000) {
            double t = now_us();
            for (int i = 0; i < 32; i++) {
                routine[k](dst, src, n);
                __asm__ volatile("" : : "r"(dst) : "memory");
            }
            printf(" %.0f", 32.0 * n / (now_us() - t) / 1e3);
        }
        printf("\n");
    }
    return 0;
}
