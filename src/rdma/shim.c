/*
 * The C side of async-btl's `rdma` transport: libfabric's API is mostly
 * `static inline` functions over provider tables, which only C can call.
 * This file wraps the few calls the transport makes in plain exported
 * functions over one opaque endpoint object; `src/rdma/ofi.rs` declares
 * them and is the only Rust code that calls them.
 *
 * Every function returns 0 or a negative libfabric error code (-FI_E*),
 * except where its comment says otherwise. No function keeps a pointer the
 * caller passed beyond the call, except the buffers and contexts of posted
 * operations, which the caller keeps alive until their completion is read.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define ABTL_FI_VERSION FI_VERSION(1, 9)

/* The memory-registration modes the transport can work with. Not
 * FI_MR_LOCAL: its eager frames and receive buffers are plain memory, so
 * providers that need every local buffer registered are not offered. */
#define ABTL_MR_MODES                                                         \
    (FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT)

/* One open endpoint and what it hangs off. */
struct abtl_ep {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
};

/* One completion, as the transport reads it. */
struct abtl_cqe {
    uintptr_t ctx; /* the operation's context, as an address */
    uint64_t flags;
    uint64_t len;
    uint64_t src;
};

/* One error completion. */
struct abtl_cqerr {
    void *ctx;
    uint64_t flags;
    int32_t err;
    int32_t prov_errno;
};

/* What one provider offers, for listing and choosing. */
struct abtl_prov {
    const char *prov_name;
    const char *fabric_name;
    const char *domain_name;
    uint64_t mr_mode;
    uint64_t mr_key_size;
    uint64_t max_msg_size;
    uint64_t inject_size;
    uint32_t progress;
    uint32_t wait_fd;
    uint64_t iov_limit;
};

/*
 * libinfinipath (the PSM library some libfabric builds, Debian's among
 * them, link for the old `psm` provider) installs handlers for SIGINT,
 * SIGILL, SIGABRT, SIGBUS, SIGSEGV and SIGTERM when it is loaded, before
 * the program's main. They end the process with exit code 1: a tokio
 * program's own SIGTERM/SIGINT handling (which chains to the handler it
 * found) and Rust's stack-overflow report would be overridden in every
 * program that links async-btl with the `rdma` feature. This constructor
 * runs after the shared libraries' own and puts back the default action
 * for each of those signals whose handler lies in libinfinipath; any other
 * handler is left alone.
 */
__attribute__((constructor)) static void abtl_restore_signals(void)
{
    static const int sigs[] = {SIGINT, SIGILL, SIGABRT, SIGBUS, SIGSEGV, SIGTERM};
    size_t i;

    for (i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
        struct sigaction sa;
        Dl_info di;
        void *h;

        if (sigaction(sigs[i], NULL, &sa) != 0)
            continue;
        h = (sa.sa_flags & SA_SIGINFO) ? (void *)sa.sa_sigaction
                                       : (void *)sa.sa_handler;
        if (h == (void *)SIG_DFL || h == (void *)SIG_IGN)
            continue;
        if (dladdr(h, &di) && di.dli_fname &&
            strstr(di.dli_fname, "libinfinipath")) {
            memset(&sa, 0, sizeof(sa));
            sa.sa_handler = SIG_DFL;
            sigemptyset(&sa.sa_mask);
            sigaction(sigs[i], &sa, NULL);
        }
    }
}

uint32_t abtl_fi_version(void) { return fi_version(); }

const char *abtl_strerror(int err) { return fi_strerror(err); }

/*
 * The providers that offer reliable datagram endpoints with messages and
 * RMA, optionally only `prov` (a name such as "tcp;ofi_rxm") and bound to
 * `node` (an address of this host, or NULL). The list is freed with
 * abtl_freeinfo.
 */
int abtl_getinfo(const char *prov, const char *node, struct fi_info **out)
{
    struct fi_info *hints = fi_allocinfo();
    int ret;

    if (!hints)
        return -FI_ENOMEM;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA | FI_SOURCE | FI_SEND | FI_RECV | FI_READ |
                  FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = ABTL_MR_MODES;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    if (prov) {
        hints->fabric_attr->prov_name = strdup(prov);
        if (!hints->fabric_attr->prov_name) {
            fi_freeinfo(hints);
            return -FI_ENOMEM;
        }
    }
    ret = fi_getinfo(ABTL_FI_VERSION, node, NULL, node ? FI_SOURCE : 0, hints,
                     out);
    fi_freeinfo(hints);
    return ret;
}

void abtl_freeinfo(struct fi_info *info) { fi_freeinfo(info); }

/* The next entry of a list, or NULL. */
struct fi_info *abtl_info_next(struct fi_info *info) { return info->next; }

/* What `info` offers. Its strings live as long as `info`. */
void abtl_info_describe(const struct fi_info *info, struct abtl_prov *out)
{
    memset(out, 0, sizeof(*out));
    out->prov_name = info->fabric_attr ? info->fabric_attr->prov_name : NULL;
    out->fabric_name = info->fabric_attr ? info->fabric_attr->name : NULL;
    out->domain_name = info->domain_attr ? info->domain_attr->name : NULL;
    if (info->domain_attr) {
        out->mr_mode = (uint64_t)info->domain_attr->mr_mode;
        out->mr_key_size = info->domain_attr->mr_key_size;
        out->progress = (uint32_t)info->domain_attr->data_progress;
    }
    if (info->ep_attr)
        out->max_msg_size = info->ep_attr->max_msg_size;
    if (info->tx_attr) {
        out->inject_size = info->tx_attr->inject_size;
        out->iov_limit = info->tx_attr->iov_limit;
    }
}

static void abtl_close_fid(struct fid *f)
{
    if (f)
        fi_close(f);
}

void abtl_close(struct abtl_ep *e)
{
    if (!e)
        return;
    abtl_close_fid(e->ep ? &e->ep->fid : NULL);
    abtl_close_fid(e->av ? &e->av->fid : NULL);
    abtl_close_fid(e->cq ? &e->cq->fid : NULL);
    abtl_close_fid(e->domain ? &e->domain->fid : NULL);
    abtl_close_fid(e->fabric ? &e->fabric->fid : NULL);
    if (e->info)
        fi_freeinfo(e->info);
    free(e);
}

/*
 * Open an endpoint on the provider `info` describes (one entry of an
 * abtl_getinfo list, copied: the list may be freed afterwards), with a
 * completion queue that has a waitable file descriptor when `want_fd`.
 */
int abtl_open(const struct fi_info *info, int want_fd, size_t cq_size,
              struct abtl_ep **out)
{
    struct fi_cq_attr cq_attr;
    struct fi_av_attr av_attr;
    struct abtl_ep *e;
    int ret;

    e = calloc(1, sizeof(*e));
    if (!e)
        return -FI_ENOMEM;
    e->info = fi_dupinfo(info);
    if (!e->info) {
        free(e);
        return -FI_ENOMEM;
    }
    e->info->next = NULL;
    ret = fi_fabric(e->info->fabric_attr, &e->fabric, NULL);
    if (ret)
        goto fail;
    ret = fi_domain(e->fabric, e->info, &e->domain, NULL);
    if (ret)
        goto fail;
    memset(&cq_attr, 0, sizeof(cq_attr));
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = cq_size;
    cq_attr.wait_obj = want_fd ? FI_WAIT_FD : FI_WAIT_NONE;
    ret = fi_cq_open(e->domain, &cq_attr, &e->cq, NULL);
    if (ret)
        goto fail;
    memset(&av_attr, 0, sizeof(av_attr));
    av_attr.type = FI_AV_TABLE;
    ret = fi_av_open(e->domain, &av_attr, &e->av, NULL);
    if (ret)
        goto fail;
    ret = fi_endpoint(e->domain, e->info, &e->ep, NULL);
    if (ret)
        goto fail;
    ret = fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV);
    if (ret)
        goto fail;
    ret = fi_ep_bind(e->ep, &e->av->fid, 0);
    if (ret)
        goto fail;
    ret = fi_enable(e->ep);
    if (ret)
        goto fail;
    *out = e;
    return 0;
fail:
    abtl_close(e);
    return ret;
}

/* The chosen provider's description (see abtl_info_describe). */
void abtl_describe(const struct abtl_ep *e, struct abtl_prov *out)
{
    abtl_info_describe(e->info, out);
}

/* The completion queue's file descriptor, or a negative error. */
int abtl_wait_fd(struct abtl_ep *e)
{
    int fd = -1;
    int ret = fi_control(&e->cq->fid, FI_GETWAIT, &fd);
    return ret ? ret : fd;
}

/* 0: nothing is pending and the fd may be waited on; -FI_EAGAIN: read the
 * queue first. */
int abtl_trywait(struct abtl_ep *e)
{
    struct fid *fids[1] = {&e->cq->fid};
    return fi_trywait(e->fabric, fids, 1);
}

/* Our address: up to *len bytes into buf; *len is set to its size. */
int abtl_getname(struct abtl_ep *e, void *buf, size_t *len)
{
    return fi_getname(&e->ep->fid, buf, len);
}

/* Add a peer's address; *out is its handle for sends and RMA. */
int abtl_av_insert(struct abtl_ep *e, const void *addr, uint64_t *out)
{
    fi_addr_t a = FI_ADDR_NOTAVAIL;
    int ret = fi_av_insert(e->av, addr, 1, &a, 0, NULL);
    if (ret != 1)
        return ret < 0 ? ret : -FI_EINVAL;
    *out = (uint64_t)a;
    return 0;
}

/*
 * Register `len` bytes at `buf` for `access` (FI_* access bits), asking
 * for `requested_key` (ignored where the provider picks keys). *mr is the
 * handle to close, *key the key a peer names it by, *desc the local
 * descriptor for operations on it.
 */
int abtl_mr_reg(struct abtl_ep *e, void *buf, size_t len, uint64_t access,
                uint64_t requested_key, struct fid_mr **mr, uint64_t *key,
                void **desc)
{
    int ret = fi_mr_reg(e->domain, buf, len, access, 0, requested_key, 0, mr,
                        NULL);
    if (ret)
        return ret;
    if (e->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        ret = fi_mr_bind(*mr, &e->ep->fid, 0);
        if (!ret)
            ret = fi_mr_enable(*mr);
        if (ret) {
            fi_close(&(*mr)->fid);
            *mr = NULL;
            return ret;
        }
    }
    *key = fi_mr_key(*mr);
    *desc = fi_mr_desc(*mr);
    return 0;
}

int abtl_mr_close(struct fid_mr *mr) { return fi_close(&mr->fid); }

/* Post a receive buffer for a message from anyone. */
int abtl_recv(struct abtl_ep *e, void *buf, size_t len, void *desc, void *ctx)
{
    return (int)fi_recv(e->ep, buf, len, desc, FI_ADDR_UNSPEC, ctx);
}

/* Send a message; completes when the data left our buffer. */
int abtl_send(struct abtl_ep *e, const void *buf, size_t len, void *desc,
              uint64_t dest, void *ctx)
{
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct fi_msg msg = {
        .msg_iov = &iov,
        .desc = &desc,
        .iov_count = 1,
        .addr = (fi_addr_t)dest,
        .context = ctx,
    };
    return (int)fi_sendmsg(e->ep, &msg, FI_COMPLETION);
}

/* Send a header and a body that lie apart as one message (no copy of the
 * body into a frame); completes when both left our buffers. */
int abtl_sendv(struct abtl_ep *e, const void *hdr, size_t hlen,
               const void *body, size_t blen, uint64_t dest, void *ctx)
{
    struct iovec iov[2] = {
        {.iov_base = (void *)hdr, .iov_len = hlen},
        {.iov_base = (void *)body, .iov_len = blen},
    };
    void *desc[2] = {NULL, NULL};
    struct fi_msg msg = {
        .msg_iov = iov,
        .desc = desc,
        .iov_count = 2,
        .addr = (fi_addr_t)dest,
        .context = ctx,
    };
    return (int)fi_sendmsg(e->ep, &msg, FI_COMPLETION);
}

/* RDMA write or read of `len` bytes at `buf` to/from the peer's `raddr`
 * under `rkey`: a write completes once the data is in the target's memory
 * (delivery complete), a read once it is in ours. */
int abtl_rma(struct abtl_ep *e, int write, void *buf, size_t len, void *desc,
             uint64_t dest, uint64_t raddr, uint64_t rkey, void *ctx)
{
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct fi_rma_iov riov = {.addr = raddr, .len = len, .key = rkey};
    struct fi_msg_rma msg = {
        .msg_iov = &iov,
        .desc = &desc,
        .iov_count = 1,
        .addr = (fi_addr_t)dest,
        .rma_iov = &riov,
        .rma_iov_count = 1,
        .context = ctx,
    };
    if (write)
        return (int)fi_writemsg(e->ep, &msg,
                                FI_COMPLETION | FI_DELIVERY_COMPLETE);
    return (int)fi_readmsg(e->ep, &msg, FI_COMPLETION);
}

/*
 * Read up to `n` completions into `out`. Returns how many (0: none),
 * -FI_EAVAIL when an error completion is next (read it with
 * abtl_cq_readerr), or another negative error.
 */
int abtl_cq_read(struct abtl_ep *e, struct abtl_cqe *out, size_t n)
{
    struct fi_cq_data_entry ent[32];
    fi_addr_t src[32];
    ssize_t got, i;

    if (n > 32)
        n = 32;
    got = fi_cq_readfrom(e->cq, ent, n, src);
    if (got == -FI_EAGAIN)
        return 0;
    if (got < 0)
        return (int)got;
    for (i = 0; i < got; i++) {
        out[i].ctx = (uintptr_t)ent[i].op_context;
        out[i].flags = ent[i].flags;
        out[i].len = ent[i].len;
        out[i].src = (uint64_t)src[i];
    }
    return (int)got;
}

/* Read one error completion: 1 when one was read, 0 when none. */
int abtl_cq_readerr(struct abtl_ep *e, struct abtl_cqerr *out)
{
    struct fi_cq_err_entry err;
    ssize_t ret;

    memset(&err, 0, sizeof(err));
    ret = fi_cq_readerr(e->cq, &err, 0);
    if (ret == -FI_EAGAIN)
        return 0;
    if (ret < 0)
        return (int)ret;
    out->ctx = err.op_context;
    out->flags = err.flags;
    out->err = err.err;
    out->prov_errno = err.prov_errno;
    return 1;
}

/* The flag values the Rust side tests completions and modes against. */
uint64_t abtl_const(int which)
{
    switch (which) {
    case 0: return FI_SEND;
    case 1: return FI_RECV;
    case 2: return FI_WRITE;
    case 3: return FI_READ;
    case 4: return FI_REMOTE_READ;
    case 5: return FI_REMOTE_WRITE;
    case 6: return FI_MR_LOCAL;
    case 7: return FI_MR_VIRT_ADDR;
    case 8: return FI_MR_PROV_KEY;
    case 9: return FI_PROGRESS_MANUAL;
    case 10: return FI_ADDR_NOTAVAIL;
    case 11: return FI_EAGAIN;
    case 12: return FI_EAVAIL;
    case 13: return FI_ENOKEY;
    case 14: return FI_ECANCELED;
    case 15: return FI_MR_ALLOCATED;
    case 16: return FI_MR_ENDPOINT;
    default: return 0;
    }
}
