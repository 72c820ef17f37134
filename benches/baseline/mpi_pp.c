/* Open MPI baseline for btl-perf, measured on the same machine.
 *
 * Two ranks. "lat": ping-pong, prints half the round trip in microseconds.
 * "bw": rank 0 sends a window of nonblocking sends, rank 1 posts the
 * matching receives and answers with a 4-byte ack; prints MB/s (10^6 B/s).
 * Sizes double from MIN to MAX. Build: mpicc -O2 -o mpi_pp mpi_pp.c
 * Run: mpirun -np 2 --bind-to core ./mpi_pp lat|bw [min] [max] [iters]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WINDOW 64

static int iters_for(long size, int iters) {
    long n = iters;
    if (size > 8192) n = n * 8192 / size;
    return n < 20 ? 20 : (int)n;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const char *test = argc > 1 ? argv[1] : "lat";
    long min = argc > 2 ? atol(argv[2]) : 8;
    long max = argc > 3 ? atol(argv[3]) : (1 << 20);
    int iters = argc > 4 ? atoi(argv[4]) : 10000;
    char *buf = malloc(max), *rbuf = malloc((size_t)max * WINDOW);
    memset(buf, 1, max);
    memset(rbuf, 0, (size_t)max * WINDOW);
    MPI_Request req[WINDOW];
    int bw = strcmp(test, "bw") == 0;
    if (rank == 0) printf("# open-mpi %s (%s)\n", test, bw ? "MB/s" : "us");
    for (long size = min; size <= max; size *= 2) {
        int n = iters_for(size, iters), warm = n / 10 + 1;
        if (bw) n = n / 10 + 2;
        int win = WINDOW;
        while (win > 1 && (long)win * size > (16L << 20)) win /= 2;
        double t0 = 0;
        for (int i = 0; i < n + warm; i++) {
            if (i == warm) {
                MPI_Barrier(MPI_COMM_WORLD);
                t0 = MPI_Wtime();
            }
            if (!bw) {
                if (rank == 0) {
                    MPI_Send(buf, size, MPI_CHAR, 1, 1, MPI_COMM_WORLD);
                    MPI_Recv(rbuf, size, MPI_CHAR, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                } else {
                    MPI_Recv(rbuf, size, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                    MPI_Send(buf, size, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
                }
            } else if (rank == 0) {
                for (int w = 0; w < win; w++)
                    MPI_Isend(buf, size, MPI_CHAR, 1, 2, MPI_COMM_WORLD, &req[w]);
                MPI_Waitall(win, req, MPI_STATUSES_IGNORE);
                MPI_Recv(rbuf, 4, MPI_CHAR, 1, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else {
                for (int w = 0; w < win; w++)
                    MPI_Irecv(rbuf + (size_t)w * size, size, MPI_CHAR, 0, 2, MPI_COMM_WORLD, &req[w]);
                MPI_Waitall(win, req, MPI_STATUSES_IGNORE);
                MPI_Send(buf, 4, MPI_CHAR, 0, 3, MPI_COMM_WORLD);
            }
        }
        double dt = MPI_Wtime() - t0;
        if (rank == 0) {
            if (bw)
                printf("%-10ld %12.2f\n", size, (double)size * win * n / dt / 1e6);
            else
                printf("%-10ld %12.2f\n", size, dt / n / 2 * 1e6);
        }
    }
    free(buf);
    free(rbuf);
    MPI_Finalize();
    return 0;
}
