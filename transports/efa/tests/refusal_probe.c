/*
 * What a libfabric provider does with RMA it must refuse, measured without our transport.
 *
 * Two RDM endpoints of one provider in one process: a target T with one exported region E (remote
 * read/write, one key) directly below a private region P (never registered), and an initiator I.
 * Cases, each printed as one `key=value` line:
 *   forged_write / forged_read: E's key, an address inside P (key valid, range not);
 *   dereg_write: a write with the key of a region T has deregistered;
 *   in_range_read: a legitimate read of E, the control.
 * For each: the initiator's status (ok / error <fi errno> / none within the timeout), whether any
 * byte of P or E changed, and for reads what the destination now holds: how many bytes equal P's
 * (the private bytes), the payload of I's previous write (stale bytes of I's own), or nothing new.
 * `av_dup` runs in a child process: insert one address twice, remove it twice, insert it again,
 * reporting how the child ended (libfabric 2.6 shm divides by a peer count driven to 0).
 *
 * Build: gcc -O1 -o refusal_probe refusal_probe.c -I../libfabric/include <path>/libfabric.so.1 (the
 *        crate's vendored 2.6 headers; any libfabric >= 1.17, as tests/refusal_probe.rs does)
 * Run:   ./refusal_probe shm      (or "tcp;ofi_rxm")
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
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

#define REGION 65536
#define TIMEOUT_MS 2000

#define CHECK(call)                                                                    \
    do {                                                                               \
        int rc_ = (int)(call);                                                         \
        if (rc_) {                                                                     \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, fi_strerror(-rc_)); \
            exit(2);                                                                   \
        }                                                                              \
    } while (0)

struct node {
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    char addr[256];
    size_t addrlen;
};

static struct fi_info *info;
static int virt_addr, local_desc, bind_ep, prov_key;

static void open_node(struct node *n) {
    CHECK(fi_fabric(info->fabric_attr, &n->fabric, NULL));
    CHECK(fi_domain(n->fabric, info, &n->domain, NULL));
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    CHECK(fi_av_open(n->domain, &av_attr, &n->av, NULL));
    struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_CONTEXT, .size = 64, .wait_obj = FI_WAIT_NONE};
    CHECK(fi_cq_open(n->domain, &cq_attr, &n->cq, NULL));
    CHECK(fi_endpoint(n->domain, info, &n->ep, NULL));
    CHECK(fi_ep_bind(n->ep, &n->av->fid, 0));
    CHECK(fi_ep_bind(n->ep, &n->cq->fid, FI_TRANSMIT | FI_RECV));
    CHECK(fi_enable(n->ep));
    n->addrlen = sizeof(n->addr);
    CHECK(fi_getname(&n->ep->fid, n->addr, &n->addrlen));
}

static uint64_t next_key = 0x5eed0001;

static struct fid_mr *reg(struct node *n, void *buf, size_t len, uint64_t access) {
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct fi_mr_attr attr = {.mr_iov = &iov, .iov_count = 1, .access = access, .requested_key = next_key++};
    struct fid_mr *mr;
    CHECK(fi_mr_regattr(n->domain, &attr, 0, &mr));
    if (bind_ep) {
        CHECK(fi_mr_bind(mr, &n->ep->fid, 0));
        CHECK(fi_mr_enable(mr));
    }
    return mr;
}

/* Drives both endpoints until I's operation completes or the timeout passes. Returns "ok",
 * "error <errno>" or "none". */
static const char *wait_op(struct node *i, struct node *t, char *out, size_t out_len) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        void *ctx;
        fi_cq_read(t->cq, &ctx, 1); /* progress the target */
        ssize_t rc = fi_cq_read(i->cq, &ctx, 1);
        if (rc == 1) return "ok";
        if (rc == -FI_EAVAIL) {
            struct fi_cq_err_entry e;
            memset(&e, 0, sizeof(e));
            fi_cq_readerr(i->cq, &e, 0);
            snprintf(out, out_len, "error_%d", e.err);
            return out;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000 > TIMEOUT_MS)
            return "none";
    }
}

/* Posts one RMA, driving both endpoints while the provider says -FI_EAGAIN (shm: the peer is not
 * connected yet). Returns 0 or the error. */
static ssize_t post(struct node *i, struct node *t, int is_read, void *buf, size_t len, void *desc, fi_addr_t dest,
                    uint64_t raddr, uint64_t key) {
    for (int tries = 0; tries < 1000000; tries++) {
        ssize_t rc = is_read ? fi_read(i->ep, buf, len, desc, dest, raddr, key, NULL)
                             : fi_write(i->ep, buf, len, desc, dest, raddr, key, NULL);
        if (rc != -FI_EAGAIN) return rc;
        void *ctx;
        fi_cq_read(t->cq, &ctx, 1);
        fi_cq_read(i->cq, &ctx, 1);
    }
    return -FI_EAGAIN;
}

static size_t count_eq(const uint8_t *a, uint8_t v, size_t n) {
    size_t c = 0;
    for (size_t k = 0; k < n; k++) c += a[k] == v;
    return c;
}

static size_t count_ne(const uint8_t *a, uint8_t v, size_t n) { return n - count_eq(a, v, n); }

/* Fresh initiator per case: a provider that never answers a refused request leaves the old one
 * stuck. */
static void run_case(const char *name, int is_read, size_t len, struct node *t, uint8_t *e_buf, uint8_t *p_buf,
                     uint64_t e_key, uint64_t key, uint64_t raddr) {
    struct node i;
    open_node(&i);
    fi_addr_t dest;
    if (fi_av_insert(i.av, t->addr, 1, &dest, 0, NULL) != 1) {
        fprintf(stderr, "fi_av_insert failed\n");
        exit(2);
    }
    uint8_t *local = aligned_alloc(4096, REGION);
    struct fid_mr *lmr = reg(&i, local, REGION, FI_READ | FI_WRITE);
    void *desc = local_desc ? fi_mr_desc(lmr) : NULL;
    char status_buf[32];

    /* Prime the initiator with one legitimate write whose payload (0x5C) is recognisable. */
    memset(local, 0x5C, REGION);
    uint64_t e_addr = virt_addr ? (uint64_t)(uintptr_t)e_buf : 0;
    CHECK(post(&i, t, 0, local, len, desc, dest, e_addr, e_key));
    const char *prime = wait_op(&i, t, status_buf, sizeof(status_buf));
    memset(e_buf, 0xE5, REGION);

    memset(local, is_read ? 0x00 : 0x77, REGION);
    ssize_t rc = post(&i, t, is_read, local, len, desc, dest, raddr, key);
    const char *status = rc ? "post_error" : wait_op(&i, t, status_buf, sizeof(status_buf));
    printf("case=%s len=%zu prime=%s status=%s private_changed=%zu exported_changed=%zu", name, len, prime, status,
           count_ne(p_buf, 0xA5, REGION), count_ne(e_buf, 0xE5, REGION));
    if (is_read)
        printf(" dest_changed=%zu dest_private=%zu dest_own_stale=%zu dest_exported=%zu", count_ne(local, 0x00, len),
               count_eq(local, 0xA5, len), count_eq(local, 0x5C, len), count_eq(local, 0xE5, len));
    printf("\n");
    fflush(stdout);
    /* An initiator whose request never completed may still be referenced by the provider. */
    if (strcmp(status, "none") != 0) {
        fi_close(&i.ep->fid);
        fi_close(&lmr->fid);
        fi_close(&i.av->fid);
        fi_close(&i.cq->fid);
        fi_close(&i.domain->fid);
        fi_close(&i.fabric->fid);
        free(local);
    }
}

/* Inserts T's address twice into one AV, removes it twice and inserts it again, in a child. */
static void av_dup(struct node *t) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        struct node i;
        open_node(&i);
        fi_addr_t a, b, c;
        int n1 = fi_av_insert(i.av, t->addr, 1, &a, 0, NULL);
        int n2 = fi_av_insert(i.av, t->addr, 1, &b, 0, NULL);
        int r1 = fi_av_remove(i.av, &a, 1, 0);
        int r2 = fi_av_remove(i.av, &b, 1, 0);
        int n3 = fi_av_insert(i.av, t->addr, 1, &c, 0, NULL);
        printf("case=av_dup inserts=%d,%d same_fi_addr=%d removes=%d,%d reinsert=%d\n", n1, n2, a == b, r1, r2, n3);
        fflush(stdout);
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    if (WIFSIGNALED(st))
        printf("case=av_dup_child signal=%d (%s)\n", WTERMSIG(st), strsignal(WTERMSIG(st)));
    else
        printf("case=av_dup_child exit=%d\n", WEXITSTATUS(st));
}

int main(int argc, char **argv) {
    const char *prov = argc > 1 ? argv[1] : "shm";
    struct fi_info *hints = fi_allocinfo();
    hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_ALLOCATED;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    hints->fabric_attr->prov_name = strdup(prov);
    /* The older of the headers' version and the library's: 1.17 refuses a newer one (as in the shim). */
    uint32_t api = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
    if (fi_version() < api) api = fi_version();
    CHECK(fi_getinfo(api, NULL, NULL, 0, hints, &info));
    int mode = info->domain_attr->mr_mode;
    virt_addr = !!(mode & FI_MR_VIRT_ADDR);
    local_desc = !!(mode & FI_MR_LOCAL);
    bind_ep = !!(mode & FI_MR_ENDPOINT);
    prov_key = !!(mode & FI_MR_PROV_KEY);
    uint32_t v = fi_version();
    printf("libfabric=%u.%u provider=%s virt_addr=%d local_desc=%d prov_key=%d mr_key_size=%zu\n", FI_MAJOR(v),
           FI_MINOR(v), info->fabric_attr->prov_name, virt_addr, local_desc, prov_key, info->domain_attr->mr_key_size);

    struct node t;
    open_node(&t);
    /* E and P adjacent in one mapping, P directly above E, so one forged range from E covers P in
     * both addressing modes (virtual address, offset from E). */
    uint8_t *map = mmap(NULL, 3 * REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint8_t *e_buf = map, *p_buf = map + REGION, *d_buf = map + 2 * REGION;
    memset(p_buf, 0xA5, REGION);
    struct fid_mr *e_mr = reg(&t, e_buf, REGION, FI_REMOTE_READ | FI_REMOTE_WRITE);
    uint64_t e_key = fi_mr_key(e_mr);
    struct fid_mr *d_mr = reg(&t, d_buf, REGION, FI_REMOTE_READ | FI_REMOTE_WRITE);
    uint64_t d_key = fi_mr_key(d_mr);
    CHECK(fi_close(&d_mr->fid));
    memset(d_buf, 0xD5, REGION);
    uint64_t p_addr = virt_addr ? (uint64_t)(uintptr_t)p_buf : REGION;
    uint64_t e_addr = virt_addr ? (uint64_t)(uintptr_t)e_buf : 0;
    uint64_t d_addr = virt_addr ? (uint64_t)(uintptr_t)d_buf : 0;

    size_t sizes[] = {4096, REGION};
    for (int s = 0; s < 2; s++) {
        size_t len = sizes[s];
        run_case("in_range_read", 1, len, &t, e_buf, p_buf, e_key, e_key, e_addr);
        run_case("forged_write", 0, len, &t, e_buf, p_buf, e_key, e_key, p_addr);
        run_case("forged_read", 1, len, &t, e_buf, p_buf, e_key, e_key, p_addr);
        run_case("dereg_write", 0, len, &t, e_buf, p_buf, e_key, d_key, d_addr);
        printf("case=dereg_region len=%zu changed=%zu\n", len, count_ne(d_buf, 0xD5, REGION));
    }
    av_dup(&t);
    return 0;
}
