/* Raw libfabric baseline for btl-perf, measured on the same machine.
 *
 * btl-perf embeds this file, compiles it with `cc -O2 ... -lfabric` and
 * runs it for `--baseline ofi`, giving it the provider and address its
 * `rdma` transport uses and the same sizes and per-size counts as its own
 * measurements. What it measures is libfabric itself, with nothing above
 * it: the figure async-btl's `rdma` is compared with.
 *
 * Usage:
 *   ofi_pp [-p PROVIDER] [-a ADDR] [-s SPIN_US] [-c CORE0,CORE1]
 *          TEST SIZE:ITERS:WARMUP:WINDOW ... [TEST SIZE:ITERS:WARMUP:WINDOW ...]
 * PROVIDER is a name as fi_info prints it (default "tcp;ofi_rxm"), ADDR
 * the address of this host to bind it to (default 127.0.0.1). ITERS,
 * WARMUP and WINDOW may be left off: 1000, ITERS/10, 64.
 *
 * Two processes: the program forks; the parent is rank 0 (it times and
 * prints), the child rank 1. Each opens its own endpoint with the hints
 * async-btl's rdma transport uses (reliable datagram endpoint with
 * messages and RMA, FI_AV_TABLE, one completion queue of format
 * FI_CQ_FORMAT_DATA with an FI_WAIT_FD wait object, libfabric API 1.9),
 * registers one buffer for everything, and the two trade their
 * fi_getname addresses, remote keys and target addresses over a
 * socketpair, which also carries the barrier before each point.
 *
 * Progress is the one async-btl's Adaptive mode makes: fi_cq_read in a
 * loop while completions come, and after SPIN_US microseconds without
 * one (default 200, async-btl's default spin), fi_trywait and poll(2) on
 * the queue's wait fd, at most 2 ms at a time (the fallback of a wake-up
 * that brings nothing; the provider's progress is manual). SPIN_US -1
 * never parks (busy polling, as BTL_PROGRESS=busy); 0 parks at once.
 * Every process keeps reading its queue while it waits, rank 1 also in
 * the one-sided tests, where the provider moves data only when called.
 *
 * Tests, with btl-perf's meaning:
 *   lat       send/recv ping-pong; half the round trip in microseconds
 *   bw        rank 0 posts WINDOW sends, rank 1 has WINDOW receives posted
 *             and answers the window with a 4-byte send; MB/s (10^6 B/s)
 *   msg_rate  the same as bw, in messages per second
 *   put_lat   one fi_writemsg with FI_DELIVERY_COMPLETE at a time (its
 *             completion says the data is in rank 1's memory);
 *             microseconds per write
 *   put_bw    WINDOW such writes, then wait for all of them; MB/s
 *   get_lat   one fi_readmsg at a time; microseconds per read
 *   get_bw    WINDOW reads, then wait for all of them; MB/s
 *   atomic_lat        one fi_fetch_atomicmsg (FI_SUM on a uint64_t of
 *                     rank 1's target) at a time; microseconds each
 *   atomic_cswap_lat  one fi_compare_atomicmsg (FI_CSWAP) at a time
 *   atomic_rate       WINDOW non-fetching fi_atomicmsg (FI_SUM) with
 *                     FI_DELIVERY_COMPLETE, then wait for all; ops/s
 * (The atomics need the provider's FI_ATOMIC, which rxm emulates; they
 * are asked for only when an atomic test is run.)
 * Writes and reads all go to offset 0 of rank 1's target, from and into
 * offset 0 of rank 0's buffer, as async-btl's do. ITERS counts round
 * trips, operations or windows. Rank 0 prints one line per point, "TEST
 * SIZE VALUE"; lines starting with '#' are comments.
 *
 * Build: cc -O2 -o ofi_pp ofi_pp.c -lfabric
 * Run:   ./ofi_pp -p 'tcp;ofi_rxm' -a 127.0.0.1 lat 8 4096 put_bw 65536:100:10:64
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_atomic.h>

enum test {
    LAT,
    BW,
    MSG_RATE,
    PUT_LAT,
    PUT_BW,
    GET_LAT,
    GET_BW,
    ATOMIC_LAT,
    ATOMIC_CSWAP_LAT,
    ATOMIC_RATE,
    NTESTS
};

static const char *names[] = {"lat",     "bw",     "msg_rate",   "put_lat",
                              "put_bw",  "get_lat", "get_bw",    "atomic_lat",
                              "atomic_cswap_lat",   "atomic_rate"};

struct point {
    enum test test;
    long size, iters, warmup, window;
};

/* Longest one park lasts. */
#define PARK_MS 2
/* Bytes of the small area that acknowledgements and "done" use. */
#define SMALL 64

/* One process's endpoint, its memory and its completion counts. */
struct fab {
    int rank, sock;
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    struct fid_mr *mr;
    void *desc;
    int fd;
    long spin_ns;
    fi_addr_t peer;
    /* The registered buffer: [send: max][small: SMALL][recv: max * window][target: max]. */
    char *base, *sbuf, *small, *rbuf, *target;
    size_t len;
    /* The peer's target, as its RMA operations name it. */
    uint64_t raddr, rkey;
    /* Per-operation context storage (some providers ask for it). */
    struct fi_context2 *ctx;
    long nctx;
    uint64_t sends, recvs, rmas;
};

static void die(const struct fab *f, const char *what, long err) {
    if (err)
        fprintf(stderr, "ofi_pp: rank %d: %s: %s\n", f->rank, what, fi_strerror((int)-err));
    else
        fprintf(stderr, "ofi_pp: rank %d: %s\n", f->rank, what);
    exit(1);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

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

static int windowed(enum test t) {
    return t == BW || t == MSG_RATE || t == PUT_BW || t == GET_BW || t == ATOMIC_RATE;
}

static int atomic(enum test t) { return t >= ATOMIC_LAT; }

/* All of `len` bytes through the socketpair, or exit. */
static void sock_write(const struct fab *f, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(f->sock, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) die(f, "the other process is gone (socketpair write)", 0);
        p += n;
        len -= (size_t)n;
    }
}

static void sock_read(const struct fab *f, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(f->sock, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) die(f, "the other process is gone (socketpair read)", 0);
        p += n;
        len -= (size_t)n;
    }
}

static void barrier(const struct fab *f) {
    char b = 0;
    sock_write(f, &b, 1);
    sock_read(f, &b, 1);
}

/* Read what the queue holds and count it; returns how many were read. */
static int poll_cq(struct fab *f) {
    struct fi_cq_data_entry e[16];
    ssize_t n = fi_cq_read(f->cq, e, 16);
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof err);
        fi_cq_readerr(f->cq, &err, 0);
        fprintf(stderr, "ofi_pp: rank %d: error completion: %s (provider error %d)\n", f->rank,
                fi_strerror(err.err), err.prov_errno);
        exit(1);
    }
    if (n < 0) die(f, "fi_cq_read", n);
    for (ssize_t i = 0; i < n; i++) {
        if (e[i].flags & FI_RECV)
            f->recvs++;
        else if (e[i].flags & FI_SEND)
            f->sends++;
        else if (e[i].flags & (FI_WRITE | FI_READ | FI_ATOMIC))
            f->rmas++;
    }
    return (int)n;
}

/* Sleep on the queue's wait fd, unless fi_trywait says it holds
 * something; also notice the other process leaving. Returns 1 when there
 * is something to progress (fi_trywait refused, or the fd woke us), 0
 * when the park timed out. */
static int park(struct fab *f) {
    struct fid *fids[1] = {&f->cq->fid};
    if (fi_trywait(f->fabric, fids, 1) != FI_SUCCESS) return 1;
    struct pollfd p[2] = {{.fd = f->fd, .events = POLLIN}, {.fd = f->sock, .events = POLLRDHUP}};
    if (poll(p, 2, PARK_MS) <= 0) return 0;
    if (p[1].revents & (POLLRDHUP | POLLHUP | POLLERR)) die(f, "the other process is gone", 0);
    return 1;
}

/* Progress until *count reaches `target`. A wake-up starts a new spell of
 * polling, as a completion does: a target whose provider moves data only
 * when called stays hot while operations keep coming. */
static void wait_for(struct fab *f, const uint64_t *count, uint64_t target) {
    int64_t idle_since = -1;
    while (*count < target) {
        if (poll_cq(f) > 0) {
            idle_since = -1;
            continue;
        }
        if (f->spin_ns < 0) continue;
        int64_t t = now_ns();
        if (idle_since < 0) idle_since = t;
        if (t - idle_since >= f->spin_ns && park(f)) idle_since = -1;
    }
}

static void *ctx(struct fab *f, long i) { return &f->ctx[i % f->nctx]; }

/* The posting calls: on -FI_EAGAIN (queue full), progress and try again. */
static void post_recv(struct fab *f, void *buf, size_t len, long c) {
    ssize_t r;
    while ((r = fi_recv(f->ep, buf, len, f->desc, FI_ADDR_UNSPEC, ctx(f, c))) == -FI_EAGAIN)
        poll_cq(f);
    if (r) die(f, "fi_recv", r);
}

/* Rank 1's receives of a window of `n` messages of `size` bytes, from
 * `*posted` on, while fewer than the provider's receive queue holds are
 * outstanding (`done` of the window's completed): a window longer than the
 * queue (msg_rate's 4096 over tcp;ofi_rxm, whose queue takes 2048) is
 * posted as its first receives complete. */
static void top_up(struct fab *f, size_t size, long n, long *posted, long done) {
    long cap = f->info->rx_attr->size > 0 && f->info->rx_attr->size < (size_t)n
                   ? (long)f->info->rx_attr->size
                   : n;
    for (; *posted < n && *posted - done < cap; (*posted)++)
        post_recv(f, f->rbuf + (size_t)*posted * size, size, *posted);
}

static void post_send(struct fab *f, void *buf, size_t len, long c) {
    ssize_t r;
    while ((r = fi_send(f->ep, buf, len, f->desc, f->peer, ctx(f, c))) == -FI_EAGAIN) poll_cq(f);
    if (r) die(f, "fi_send", r);
}

/* An RDMA write that completes once the data is in the target's memory,
 * or an RDMA read that completes once it is in ours. */
static void post_rma(struct fab *f, int write, size_t len, long c) {
    struct iovec iov = {.iov_base = f->sbuf, .iov_len = len};
    struct fi_rma_iov riov = {.addr = f->raddr, .len = len, .key = f->rkey};
    struct fi_msg_rma msg = {
        .msg_iov = &iov,
        .desc = &f->desc,
        .iov_count = 1,
        .addr = f->peer,
        .rma_iov = &riov,
        .rma_iov_count = 1,
        .context = ctx(f, c),
    };
    ssize_t r;
    for (;;) {
        r = write ? fi_writemsg(f->ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE)
                  : fi_readmsg(f->ep, &msg, FI_COMPLETION);
        if (r != -FI_EAGAIN) break;
        poll_cq(f);
    }
    if (r) die(f, write ? "fi_writemsg" : "fi_readmsg", r);
}

/* A remote atomic on the first uint64_t of the peer's target: fetching
 * add (result into `small`), compare-and-swap, or a non-fetching add that
 * completes once applied. */
static void post_atomic(struct fab *f, enum test t, long c) {
    struct fi_ioc iov = {.addr = f->sbuf, .count = 1};
    struct fi_rma_ioc riov = {.addr = f->raddr, .count = 1, .key = f->rkey};
    struct fi_msg_atomic msg = {
        .msg_iov = &iov,
        .desc = &f->desc,
        .iov_count = 1,
        .addr = f->peer,
        .rma_iov = &riov,
        .rma_iov_count = 1,
        .datatype = FI_UINT64,
        .op = t == ATOMIC_CSWAP_LAT ? FI_CSWAP : FI_SUM,
        .context = ctx(f, c),
    };
    struct fi_ioc res = {.addr = f->small, .count = 1};
    struct fi_ioc cmp = {.addr = f->small + 8, .count = 1};
    ssize_t r;
    for (;;) {
        if (t == ATOMIC_LAT)
            r = fi_fetch_atomicmsg(f->ep, &msg, &res, &f->desc, 1, FI_COMPLETION);
        else if (t == ATOMIC_CSWAP_LAT)
            r = fi_compare_atomicmsg(f->ep, &msg, &cmp, &f->desc, 1, &res, &f->desc, 1,
                                     FI_COMPLETION);
        else
            r = fi_atomicmsg(f->ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
        if (r != -FI_EAGAIN) break;
        poll_cq(f);
    }
    if (r) die(f, "an atomic", r);
}

/* Open the endpoint, register `len` bytes, and meet the other process. */
static void open_fab(struct fab *f, const char *prov, const char *addr, long cq_size,
                     int atomics) {
    struct fi_info *hints = fi_allocinfo();
    if (!hints) die(f, "fi_allocinfo", 0);
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA | FI_SOURCE | FI_SEND | FI_RECV | FI_READ | FI_WRITE |
                  FI_REMOTE_READ | FI_REMOTE_WRITE | (atomics ? FI_ATOMIC : 0);
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    hints->fabric_attr->prov_name = strdup(prov);
    int ret = fi_getinfo(FI_VERSION(1, 9), addr, NULL, FI_SOURCE, hints, &f->info);
    fi_freeinfo(hints);
    if (ret) die(f, "fi_getinfo (no such provider here, or it cannot bind the address)", ret);
    if ((ret = fi_fabric(f->info->fabric_attr, &f->fabric, NULL))) die(f, "fi_fabric", ret);
    if ((ret = fi_domain(f->fabric, f->info, &f->domain, NULL))) die(f, "fi_domain", ret);
    struct fi_cq_attr cq_attr = {
        .size = (size_t)cq_size, .format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_FD};
    if ((ret = fi_cq_open(f->domain, &cq_attr, &f->cq, NULL))) die(f, "fi_cq_open", ret);
    if ((ret = fi_control(&f->cq->fid, FI_GETWAIT, &f->fd))) die(f, "FI_GETWAIT", ret);
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    if ((ret = fi_av_open(f->domain, &av_attr, &f->av, NULL))) die(f, "fi_av_open", ret);
    if ((ret = fi_endpoint(f->domain, f->info, &f->ep, NULL))) die(f, "fi_endpoint", ret);
    if ((ret = fi_ep_bind(f->ep, &f->cq->fid, FI_TRANSMIT | FI_RECV))) die(f, "bind cq", ret);
    if ((ret = fi_ep_bind(f->ep, &f->av->fid, 0))) die(f, "bind av", ret);
    if ((ret = fi_enable(f->ep))) die(f, "fi_enable", ret);

    uint64_t mr_mode = f->info->domain_attr->mr_mode;
    ret = fi_mr_reg(f->domain, f->base, f->len,
                    FI_SEND | FI_RECV | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE, 0,
                    (uint64_t)f->rank + 1, 0, &f->mr, NULL);
    if (ret) die(f, "fi_mr_reg", ret);
    if (mr_mode & FI_MR_ENDPOINT) {
        if ((ret = fi_mr_bind(f->mr, &f->ep->fid, 0))) die(f, "fi_mr_bind", ret);
        if ((ret = fi_mr_enable(f->mr))) die(f, "fi_mr_enable", ret);
    }
    f->desc = fi_mr_desc(f->mr);

    /* Addresses, then our target's key and address, each way. */
    char name[256];
    size_t nlen = sizeof name;
    if ((ret = fi_getname(&f->ep->fid, name, &nlen))) die(f, "fi_getname", ret);
    uint64_t mine[3] = {nlen, fi_mr_key(f->mr),
                        (mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)f->target
                                                    : (uint64_t)(f->target - f->base)};
    uint64_t theirs[3];
    char peer[256];
    sock_write(f, mine, sizeof mine);
    sock_write(f, name, nlen);
    sock_read(f, theirs, sizeof theirs);
    if (theirs[0] > sizeof peer) die(f, "the peer's address is too long", 0);
    sock_read(f, peer, theirs[0]);
    f->rkey = theirs[1];
    f->raddr = theirs[2];
    if (fi_av_insert(f->av, peer, 1, &f->peer, 0, NULL) != 1) die(f, "fi_av_insert", 0);
}

static void close_fab(struct fab *f) {
    fi_close(&f->ep->fid);
    fi_close(&f->mr->fid);
    fi_close(&f->av->fid);
    fi_close(&f->cq->fid);
    fi_close(&f->domain->fid);
    fi_close(&f->fabric->fid);
    fi_freeinfo(f->info);
}

/* One point; rank 0 returns its value, rank 1 0. */
static double run(struct fab *f, const struct point *p) {
    long n = windowed(p->test) ? p->window : 1, turns = p->warmup + p->iters;
    size_t size = (size_t)p->size;
    int64_t t0 = 0;
    f->sends = f->recvs = f->rmas = 0;
    int rma = p->test >= PUT_LAT;
    long posted = 0;
    /* Rank 1's first receives are posted before the barrier. */
    if (f->rank == 1) {
        if (p->test == LAT)
            post_recv(f, f->rbuf, size, 0);
        else if (rma)
            post_recv(f, f->small, 4, 0);
        else
            top_up(f, size, n, &posted, 0);
    }
    barrier(f);
    if (f->rank == 1) {
        if (rma) {
            /* The target: progress until rank 0 says it is done. */
            wait_for(f, &f->recvs, 1);
            return 0;
        }
        for (long i = 0; i < turns; i++) {
            uint64_t base = (uint64_t)i * n;
            while (f->recvs < base + n) {
                wait_for(f, &f->recvs, f->recvs + 1);
                if (p->test != LAT) top_up(f, size, n, &posted, (long)(f->recvs - base));
            }
            if (p->test == LAT) {
                if (i + 1 < turns) post_recv(f, f->rbuf, size, 0);
                post_send(f, f->sbuf, size, 1);
            } else {
                posted = 0;
                if (i + 1 < turns) top_up(f, size, n, &posted, 0);
                post_send(f, f->small, 4, n);
            }
            wait_for(f, &f->sends, (uint64_t)i + 1);
        }
        return 0;
    }
    for (long i = 0; i < turns; i++) {
        if (i == p->warmup) t0 = now_ns();
        switch (p->test) {
        case LAT:
            post_recv(f, f->rbuf, size, 0);
            post_send(f, f->sbuf, size, 1);
            wait_for(f, &f->sends, (uint64_t)i + 1);
            wait_for(f, &f->recvs, (uint64_t)i + 1);
            break;
        case BW:
        case MSG_RATE:
            post_recv(f, f->small, 4, n);
            for (long w = 0; w < n; w++) post_send(f, f->sbuf, size, w);
            wait_for(f, &f->sends, (uint64_t)(i + 1) * n);
            wait_for(f, &f->recvs, (uint64_t)i + 1);
            break;
        default:
            for (long w = 0; w < n; w++) {
                if (atomic(p->test))
                    post_atomic(f, p->test, w);
                else
                    post_rma(f, p->test == PUT_LAT || p->test == PUT_BW, size, w);
            }
            wait_for(f, &f->rmas, (uint64_t)(i + 1) * n);
            break;
        }
    }
    double secs = (double)(now_ns() - t0) / 1e9;
    if (secs <= 0) secs = 1e-9;
    if (rma) {
        post_send(f, f->small, 4, n);
        wait_for(f, &f->sends, 1);
    }
    double ops = (double)n * (double)p->iters;
    switch (p->test) {
    case LAT: return secs * 1e6 / (double)p->iters / 2;
    case PUT_LAT:
    case GET_LAT:
    case ATOMIC_LAT:
    case ATOMIC_CSWAP_LAT: return secs * 1e6 / (double)p->iters;
    case MSG_RATE:
    case ATOMIC_RATE: return ops / secs;
    default: return ops * (double)size / secs / 1e6;
    }
}

static void pin(int core) {
    if (core < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) perror("ofi_pp: sched_setaffinity");
}

static int usage(void) {
    fprintf(stderr, "usage: ofi_pp [-p PROVIDER] [-a ADDR] [-s SPIN_US] [-c CORE0,CORE1] "
                    "TEST SIZE[:ITERS[:WARMUP[:WINDOW]]]... (TEST: lat, bw, msg_rate, put_lat, "
                    "put_bw, get_lat, get_bw; window bytes at most 1 GiB)\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *prov = "tcp;ofi_rxm", *addr = "127.0.0.1";
    long spin_us = 200;
    int cores[2] = {-1, -1}, opt;
    while ((opt = getopt(argc, argv, "+p:a:s:c:")) != -1) {
        switch (opt) {
        case 'p': prov = optarg; break;
        case 'a': addr = optarg; break;
        case 's': spin_us = strtol(optarg, NULL, 10); break;
        case 'c':
            if (sscanf(optarg, "%d,%d", &cores[0], &cores[1]) != 2) return usage();
            break;
        default: return usage();
        }
    }
    struct point *pts = calloc((size_t)argc, sizeof *pts);
    int npts = 0, test = -1;
    long max = SMALL, maxwin = 1, maxops = 1;
    int atomics = 0;
    for (int a = optind; a < argc; a++) {
        int t = test_of(argv[a]);
        if (t >= 0) {
            test = t;
            continue;
        }
        struct point *p = &pts[npts];
        if (test < 0 || !parse_point(argv[a], p)) {
            fprintf(stderr, "ofi_pp: bad argument %s\n", argv[a]);
            return usage();
        }
        npts++;
        p->test = test;
        if (!windowed(p->test)) p->window = 1;
        if (p->size * p->window > (1L << 30)) return usage();
        if (p->size > max) max = p->size;
        if ((p->test == BW || p->test == MSG_RATE) && p->window > maxwin) maxwin = p->window;
        if (p->window > maxops) maxops = p->window;
        if (atomic(p->test)) atomics = 1;
    }
    if (npts == 0) return usage();

    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
        perror("ofi_pp: socketpair");
        return 1;
    }
    fflush(stdout);
    pid_t child = fork();
    if (child < 0) {
        perror("ofi_pp: fork");
        return 1;
    }
    struct fab f;
    memset(&f, 0, sizeof f);
    f.rank = child == 0;
    f.sock = sv[f.rank];
    close(sv[1 - f.rank]);
    if (f.rank == 1) prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    pin(cores[f.rank]);
    f.spin_ns = spin_us < 0 ? -1 : spin_us * 1000;
    f.len = (size_t)max * (size_t)(maxwin + 2) + SMALL;
    long page = sysconf(_SC_PAGESIZE);
    f.len = (f.len + (size_t)page - 1) / (size_t)page * (size_t)page;
    if (posix_memalign((void **)&f.base, (size_t)page, f.len)) die(&f, "out of memory", 0);
    memset(f.base, f.rank + 1, f.len);
    f.sbuf = f.base;
    f.small = f.sbuf + max;
    f.rbuf = f.small + SMALL;
    f.target = f.rbuf + (size_t)max * (size_t)maxwin;
    f.nctx = maxops + 2;
    f.ctx = calloc((size_t)f.nctx, sizeof *f.ctx);
    open_fab(&f, prov, addr, 2 * maxops + 1024, atomics);

    if (f.rank == 0) {
        printf("# ofi_pp: libfabric %u.%u, provider %s, fabric %s, domain %s, bound to %s, "
               "progress %s\n",
               FI_MAJOR(fi_version()), FI_MINOR(fi_version()), f.info->fabric_attr->prov_name,
               f.info->fabric_attr->name, f.info->domain_attr->name, addr,
               spin_us < 0   ? "busy polling"
               : spin_us == 0 ? "fd wait"
                              : "polling, then fd wait");
        printf("# ofi_pp: TEST SIZE VALUE (us, MB/s or msg/s)\n");
        fflush(stdout);
    }
    for (int i = 0; i < npts; i++) {
        double v = run(&f, &pts[i]);
        if (f.rank == 0) {
            printf("%s %ld %.4f\n", names[pts[i].test], pts[i].size, v);
            fflush(stdout);
        }
    }
    /* Neither closes while the other may still need it to progress. */
    barrier(&f);
    close_fab(&f);
    free(f.ctx);
    free(f.base);
    free(pts);
    if (f.rank == 1) return 0;
    int status = 0;
    if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "ofi_pp: rank 1 failed\n");
        return 1;
    }
    return 0;
}
