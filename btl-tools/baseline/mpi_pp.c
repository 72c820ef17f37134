/* Open MPI baseline for btl-perf, measured on the same machine.
 *
 * btl-perf embeds this file, compiles it with mpicc and runs it under
 * mpirun for `--baseline ompi` and `--baseline ompi-tcp`, giving it the
 * same sizes and per-size counts as its own measurements.
 *
 * Two ranks. Arguments are a list of tests, each followed by its points:
 *   TEST SIZE:ITERS:WARMUP:WINDOW ... [TEST SIZE:ITERS:WARMUP:WINDOW ...]
 * (ITERS, WARMUP and WINDOW may be left off: 1000, ITERS/10, 64).
 * Tests, with btl-perf's meaning:
 *   lat      ping-pong; half the round trip in microseconds
 *   bw       rank 0 posts WINDOW nonblocking sends, rank 1 the matching
 *            receives and answers with a 4-byte ack; MB/s (10^6 B/s)
 *   put_lat  MPI_Put then MPI_Win_flush, one at a time (passive target,
 *            shared lock held for the whole test); microseconds per put
 *   put_bw   WINDOW puts, then MPI_Win_flush; MB/s
 *   atomic_lat        MPI_Fetch_and_op (MPI_SUM, one uint64_t) then
 *                     MPI_Win_flush, one at a time; microseconds per op
 *   atomic_cswap_lat  MPI_Compare_and_swap (uint64_t, always succeeding:
 *                     the expected value is the last one returned) then
 *                     MPI_Win_flush, one at a time; microseconds per op
 *   atomic_rate       WINDOW MPI_Accumulate (MPI_SUM, one uint64_t), then
 *                     MPI_Win_flush; operations per second
 * The atomics work on 8-byte words of rank 1's window (SIZE is 8); each
 * test checks its word's final value and reports nothing if it is wrong.
 * ITERS counts round trips, puts, operations, or windows. Rank 0 prints
 * one line per point, "TEST SIZE VALUE"; lines starting with '#' are
 * comments.
 *
 * Build: mpicc -O2 -o mpi_pp mpi_pp.c
 * Run:   mpirun -np 2 --bind-to core --mca pml ob1 --mca btl self,vader \
 *          ./mpi_pp lat 8 1024 65536:100 bw 65536:100:10:64
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum test { LAT, BW, PUT_LAT, PUT_BW, ATOMIC_LAT, ATOMIC_CSWAP_LAT, ATOMIC_RATE, NTESTS };

struct point {
    enum test test;
    long size, iters, warmup, window;
};

static const char *names[] = {"lat",        "bw",         "put_lat",         "put_bw",
                              "atomic_lat", "atomic_cswap_lat", "atomic_rate"};

/* Bytes of rank 1's window the atomics use: one word per test, a cache
 * line apart. */
#define ATOMIC_BYTES 192

static int test_of(const char *s) {
    for (int t = 0; t < NTESTS; t++)
        if (strcmp(s, names[t]) == 0) return t;
    return -1;
}

/* "SIZE[:ITERS[:WARMUP[:WINDOW]]]" into p; 0 when malformed. */
static int parse_point(const char *s, struct point *p) {
    long v[4] = {0, 1000, -1, 64};
    int n = 0;
    const char *c = s;
    for (;;) {
        char *end;
        v[n++] = strtol(c, &end, 10);
        if (end == c) return 0;
        if (*end == '\0') break;
        if (*end != ':' || n == 4) return 0;
        c = end + 1;
    }
    if (v[2] < 0) v[2] = v[1] / 10;
    if (v[0] < 1 || v[1] < 1 || v[2] < 0 || v[3] < 1) return 0;
    p->size = v[0];
    p->iters = v[1];
    p->warmup = v[2];
    p->window = v[3];
    return 1;
}

static double run_lat(const struct point *p, int rank, char *buf, char *rbuf) {
    double t0 = MPI_Wtime();
    for (long i = 0; i < p->warmup + p->iters; i++) {
        if (i == p->warmup) {
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
        }
        if (rank == 0) {
            MPI_Send(buf, p->size, MPI_CHAR, 1, 1, MPI_COMM_WORLD);
            MPI_Recv(rbuf, p->size, MPI_CHAR, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
            MPI_Recv(rbuf, p->size, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Send(buf, p->size, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
        }
    }
    return (MPI_Wtime() - t0) / p->iters / 2 * 1e6;
}

static double run_bw(const struct point *p, int rank, char *buf, char *rbuf, MPI_Request *req) {
    double t0 = MPI_Wtime();
    for (long i = 0; i < p->warmup + p->iters; i++) {
        if (i == p->warmup) {
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
        }
        if (rank == 0) {
            for (long w = 0; w < p->window; w++)
                MPI_Isend(buf, p->size, MPI_CHAR, 1, 2, MPI_COMM_WORLD, &req[w]);
            MPI_Waitall(p->window, req, MPI_STATUSES_IGNORE);
            MPI_Recv(rbuf, 4, MPI_CHAR, 1, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
            for (long w = 0; w < p->window; w++)
                MPI_Irecv(rbuf + (size_t)w * p->size, p->size, MPI_CHAR, 0, 2, MPI_COMM_WORLD,
                          &req[w]);
            MPI_Waitall(p->window, req, MPI_STATUSES_IGNORE);
            MPI_Send(buf, 4, MPI_CHAR, 0, 3, MPI_COMM_WORLD);
        }
    }
    return (double)p->size * p->window * p->iters / (MPI_Wtime() - t0) / 1e6;
}

/* Rank 0 puts into rank 1's window; rank 1 only waits at the barrier. */
static double run_put(const struct point *p, int rank, char *buf, MPI_Win win) {
    double t0 = MPI_Wtime(), dt = 0;
    if (rank == 0) {
        long n = p->test == PUT_BW ? p->window : 1;
        MPI_Win_lock(MPI_LOCK_SHARED, 1, 0, win);
        for (long i = 0; i < p->warmup + p->iters; i++) {
            if (i == p->warmup) t0 = MPI_Wtime();
            for (long w = 0; w < n; w++) MPI_Put(buf, p->size, MPI_CHAR, 1, 0, p->size, MPI_CHAR, win);
            MPI_Win_flush(1, win);
        }
        dt = MPI_Wtime() - t0;
        MPI_Win_unlock(1, win);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (p->test == PUT_BW) return (double)p->size * p->window * p->iters / dt / 1e6;
    return dt / p->iters * 1e6;
}

/* Rank 0 works on a word of rank 1's window (a word per test), reads it
 * before and after, and returns a negative value if the word is wrong. */
static double run_atomic(const struct point *p, int rank, MPI_Win win) {
    double t0 = MPI_Wtime(), dt = 0;
    int ok = 1;
    MPI_Aint at = (MPI_Aint)(p->test - ATOMIC_LAT) * 64;
    if (rank == 0) {
        uint64_t one = 1, start, last, got, next;
        long n = p->test == ATOMIC_RATE ? p->window : 1;
        MPI_Win_lock(MPI_LOCK_SHARED, 1, 0, win);
        MPI_Fetch_and_op(NULL, &start, MPI_UINT64_T, 1, at, MPI_NO_OP, win);
        MPI_Win_flush(1, win);
        last = start;
        for (long i = 0; i < p->warmup + p->iters; i++) {
            if (i == p->warmup) t0 = MPI_Wtime();
            if (p->test == ATOMIC_LAT) {
                MPI_Fetch_and_op(&one, &got, MPI_UINT64_T, 1, at, MPI_SUM, win);
                MPI_Win_flush(1, win);
                ok &= got == last;
                last = got + 1;
            } else if (p->test == ATOMIC_CSWAP_LAT) {
                next = last + 1;
                MPI_Compare_and_swap(&next, &last, &got, MPI_UINT64_T, 1, at, win);
                MPI_Win_flush(1, win);
                ok &= got == last;
                last = next;
            } else {
                for (long w = 0; w < n; w++)
                    MPI_Accumulate(&one, 1, MPI_UINT64_T, 1, at, 1, MPI_UINT64_T, MPI_SUM, win);
                MPI_Win_flush(1, win);
                last += (uint64_t)n;
            }
        }
        dt = MPI_Wtime() - t0;
        MPI_Fetch_and_op(NULL, &got, MPI_UINT64_T, 1, at, MPI_NO_OP, win);
        MPI_Win_flush(1, win);
        ok &= got == last;
        MPI_Win_unlock(1, win);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (!ok) return -1;
    if (p->test == ATOMIC_RATE) return (double)p->window * p->iters / dt;
    return dt / p->iters * 1e6;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    struct point *pts = calloc(argc, sizeof *pts);
    int npts = 0, test = -1, bad = size != 2;
    long max = 4, maxwin = 1, maxput = 1;
    for (int a = 1; a < argc && !bad; a++) {
        int t = test_of(argv[a]);
        if (t >= 0) {
            test = t;
        } else if (test < 0 || !parse_point(argv[a], &pts[npts])) {
            bad = 1;
            if (rank == 0) fprintf(stderr, "mpi_pp: bad argument %s\n", argv[a]);
        } else {
            struct point *p = &pts[npts++];
            p->test = test;
            if (p->test == LAT || p->test == PUT_LAT || p->test == ATOMIC_LAT ||
                p->test == ATOMIC_CSWAP_LAT)
                p->window = 1;
            if (p->size > max) max = p->size;
            if (p->test == BW && p->window > maxwin) maxwin = p->window;
            if ((p->test == BW || p->test == PUT_BW) && p->size * p->window > (1L << 30)) bad = 1;
            if (p->test >= PUT_LAT && p->size > maxput) maxput = p->size;
            if (p->test >= ATOMIC_LAT && maxput < ATOMIC_BYTES) maxput = ATOMIC_BYTES;
        }
    }
    if (bad) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np 2 mpi_pp TEST SIZE[:ITERS[:WARMUP[:WINDOW]]]... "
                            "(TEST: lat, bw, put_lat, put_bw, atomic_lat, atomic_cswap_lat, "
                            "atomic_rate; window bytes at most 1 GiB)\n");
        MPI_Finalize();
        return 2;
    }
    /* Page-aligned, as btl-perf's own buffers and ucx_perftest's. */
    long page = sysconf(_SC_PAGESIZE);
    char *buf = NULL, *rbuf = NULL;
    if (posix_memalign((void **)&buf, (size_t)page, (size_t)max) ||
        posix_memalign((void **)&rbuf, (size_t)page, (size_t)max * maxwin)) {
        fprintf(stderr, "mpi_pp: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Request *req = malloc(sizeof *req * maxwin);
    memset(buf, 1, max);
    memset(rbuf, 0, (size_t)max * maxwin);
    MPI_Win win = MPI_WIN_NULL;
    int rma = 0;
    for (int i = 0; i < npts; i++) rma |= pts[i].test >= PUT_LAT;
    if (rma) {
        void *base;
        MPI_Win_allocate(rank == 1 ? maxput : 0, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
        /* The atomics' words start at zero. */
        if (rank == 1) {
            MPI_Win_lock(MPI_LOCK_EXCLUSIVE, 1, 0, win);
            memset(base, 0, maxput);
            MPI_Win_unlock(1, win);
        }
        MPI_Barrier(MPI_COMM_WORLD);
    }
    if (rank == 0) printf("# open-mpi mpi_pp: TEST SIZE VALUE (us, MB/s or op/s)\n");
    for (int i = 0; i < npts; i++) {
        const struct point *p = &pts[i];
        double v;
        if (p->test == LAT)
            v = run_lat(p, rank, buf, rbuf);
        else if (p->test == BW)
            v = run_bw(p, rank, buf, rbuf, req);
        else if (p->test >= ATOMIC_LAT)
            v = run_atomic(p, rank, win);
        else
            v = run_put(p, rank, buf, win);
        if (rank == 0 && v < 0) {
            printf("# %s: the word's value is wrong; no result\n", names[p->test]);
            fflush(stdout);
        } else if (rank == 0) {
            printf("%s %ld %.4f\n", names[p->test], p->size, v);
            fflush(stdout);
        }
    }
    if (rma) MPI_Win_free(&win);
    free(req);
    free(buf);
    free(rbuf);
    free(pts);
    MPI_Finalize();
    return 0;
}
