/*
 * The kernel floor of a UDP ping-pong over loopback on this machine: two
 * processes pinned to cores 0 and 1, one socket each, no protocol at all
 * (no sequence numbers, checksums, acknowledgements or retransmission).
 * Each side sends with one sendto() and waits in one of two ways:
 *
 *   poll   recvfrom(MSG_DONTWAIT) in a loop (what a polling transport does:
 *          Open MPI's TCP BTL, our udp transport while hot)
 *   block  a blocking recvfrom() (the thread sleeps and is woken)
 *
 *   cc -O2 -o udp_floor benches/c/udp_floor.c && ./udp_floor
 *
 * Prints "mode size=microseconds" per half round trip.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "probe.h"

static int bound(struct sockaddr_in *a)
{
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    socklen_t len = sizeof *a;
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || bind(fd, (struct sockaddr *)a, sizeof *a) != 0 ||
        getsockname(fd, (struct sockaddr *)a, &len) != 0) {
        perror("socket");
        exit(1);
    }
    return fd;
}

static void take(int fd, char *buf, size_t size, int poll)
{
    for (;;) {
        ssize_t n = recvfrom(fd, buf, size, poll ? MSG_DONTWAIT : 0, NULL, NULL);
        if (n >= 0)
            return;
    }
}

int main(void)
{
    static const size_t sizes[] = {8, 64, 1024, 8192};
    static char buf[65536];
    struct sockaddr_in a, b;
    int fa = bound(&a), fb = bound(&b);
    const int iters = 100000, warm = 5000;
    for (int poll = 1; poll >= 0; poll--) {
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
            size_t size = sizes[s];
            pid_t child = fork();
            if (child == 0) {
                pin(1);
                for (int i = 0; i < iters + warm; i++) {
                    take(fb, buf, sizeof buf, poll);
                    sendto(fb, buf, size, 0, (struct sockaddr *)&a, sizeof a);
                }
                _exit(0);
            }
            pin(0);
            double t0 = 0;
            for (int i = 0; i < iters + warm; i++) {
                if (i == warm)
                    t0 = now_us();
                sendto(fa, buf, size, 0, (struct sockaddr *)&b, sizeof b);
                take(fa, buf, sizeof buf, poll);
            }
            double t = now_us() - t0;
            waitpid(child, NULL, 0);
            printf("%s %zu=%.2f\n", poll ? "poll" : "block", size, t / iters / 2);
        }
    }
    return 0;
}
