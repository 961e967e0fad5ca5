/*
 * Thin C shim over libfabric for te-transport-efa.
 *
 * libfabric's data-path and object calls (fi_domain, fi_mr_regattr, fi_writemsg, fi_cq_read...) are
 * `static inline` functions in the public headers that jump through provider ops tables, so there is
 * no symbol in libfabric.so to link against. This file instantiates the few we use as real functions
 * and translates header constants into a small stable encoding so the Rust side never depends on a
 * header version. Policy (which library, which provider, which rails, what to do on errors) lives in
 * Rust; this file only forwards.
 *
 * It is compiled against the libfabric 2.6 headers that travel with the crate (libfabric/include)
 * and links no libfabric: the six functions libfabric does export (fi_getinfo, fi_freeinfo,
 * fi_dupinfo, fi_fabric, fi_strerror, fi_version) are called through pointers that te_fi_load
 * resolves with dlopen + dlvsym, so a binary starts on a host without libfabric and can run against
 * 1.17 (Debian 12) or 2.x (the EFA installer). The loading is done here rather than with the
 * `libloading` crate the other run-time-loaded libraries use (transports/rdma, plugins/cuda): these
 * pointers are called from C, and libfabric's exports are versioned (FABRIC_1.x), which needs
 * dlvsym, which libloading does not offer.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

/* The headers must be the vendored ones (build.rs also checks which files the compiler read). */
#if FI_MAJOR_VERSION != 2 || FI_MINOR_VERSION != 6
#error "fi_shim.c must be compiled against the libfabric 2.6 headers in transports/efa/libfabric/include"
#endif

/*
 * libfabric's exported functions, resolved by te_fi_load. Everything else goes through the ops
 * tables of the objects these return.
 *
 * Versions: libfabric keeps every older layout of fi_info (and its attr structs) behind versioned
 * symbols and only ever appends fields. 1.17 exports fi_getinfo/fi_freeinfo/fi_dupinfo at
 * FABRIC_1.0-1.3 (default 1.3); 2.6 adds 1.7, 1.8 and 1.9 (default 1.9, the layout of these
 * headers). We take the newest of ABI_VERSIONS the library has, so its fi_info objects are its own
 * full ones (a 1.3 fi_dupinfo on 2.6 would drop the fields appended since), and touch only fields
 * that exist in the 1.3 layout (all of ours date from 1.0). fi_fabric is at FABRIC_1.1 in both,
 * fi_strerror and fi_version at FABRIC_1.0. fi_freeinfo and fi_dupinfo come from the same version
 * as fi_getinfo, so the library frees and copies only structures it made itself.
 *
 * The API version passed to fi_getinfo is the older of these headers' (2.6) and the library's
 * fi_version(): 1.17 refuses a newer one (-FI_ENOSYS), and providers read the fields of the
 * structures we pass (fi_mr_attr, fi_cq_attr...) only as far as the requested version defines them,
 * so our larger 2.6 structures are read as the older ones they extend.
 */
static const char *const ABI_VERSIONS[] = {"FABRIC_1.9", "FABRIC_1.8", "FABRIC_1.7", "FABRIC_1.3"};

static struct {
    int (*getinfo)(uint32_t version, const char *node, const char *service, uint64_t flags,
                   const struct fi_info *hints, struct fi_info **info);
    void (*freeinfo)(struct fi_info *info);
    struct fi_info *(*dupinfo)(const struct fi_info *info);
    int (*fabric)(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
    const char *(*strerror)(int errnum);
    uint32_t (*version)(void);
    uint32_t runtime_version; /* the loaded library's fi_version() */
    uint32_t api_version;     /* what fi_getinfo is asked for */
    const char *abi;          /* the symbol version of getinfo/freeinfo/dupinfo */
} lib;

/* From here on the exported names mean the resolved pointers (fi_allocinfo is an inline
 * fi_dupinfo(NULL) in the headers: it would reference the symbol, so it is redefined too). */
#define fi_getinfo lib.getinfo
#define fi_freeinfo lib.freeinfo
#define fi_dupinfo lib.dupinfo
#define fi_fabric lib.fabric
#define fi_strerror lib.strerror
#define fi_allocinfo() lib.dupinfo(NULL)

/*
 * Opens the libfabric at `path` (a path, or a bare soname for the loader's own search) and resolves
 * the functions above. Returns 0; or 1 when dlopen fails, 2 when a function is missing at every
 * version we accept (the library is closed again), with the reason in `err`. RTLD_LOCAL: libfabric's
 * symbols stay out of the global namespace, so another copy in the process (NCCL's aws-ofi plugin
 * brings its own) does not bind to ours or ours to it. Called once, before any other function here
 * (the Rust side serialises it); the library is never closed once loaded.
 */
int te_fi_load(const char *path, char *err, size_t err_len) {
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(err, err_len, "%s", e ? e : "dlopen failed");
        return 1;
    }
    const char *abi = NULL;
    void *getinfo = NULL, *freeinfo = NULL, *dupinfo = NULL;
    for (size_t i = 0; i < sizeof(ABI_VERSIONS) / sizeof(ABI_VERSIONS[0]) && !abi; i++) {
        getinfo = dlvsym(h, "fi_getinfo", ABI_VERSIONS[i]);
        freeinfo = dlvsym(h, "fi_freeinfo", ABI_VERSIONS[i]);
        dupinfo = dlvsym(h, "fi_dupinfo", ABI_VERSIONS[i]);
        if (getinfo && freeinfo && dupinfo) abi = ABI_VERSIONS[i];
    }
    void *fabric = dlvsym(h, "fi_fabric", "FABRIC_1.1");
    void *strerror_fn = dlvsym(h, "fi_strerror", "FABRIC_1.0");
    void *version = dlvsym(h, "fi_version", "FABRIC_1.0");
    const char *missing = !abi           ? "fi_getinfo, fi_freeinfo and fi_dupinfo at FABRIC_1.3 or newer"
                          : !fabric      ? "fi_fabric@FABRIC_1.1"
                          : !strerror_fn ? "fi_strerror@FABRIC_1.0"
                          : !version     ? "fi_version@FABRIC_1.0"
                                         : NULL;
    if (missing) {
        snprintf(err, err_len, "%s has no %s", path, missing);
        dlclose(h);
        return 2;
    }
    /* POSIX: a void * from dlsym may be converted to a function pointer this way. */
    *(void **)&lib.getinfo = getinfo;
    *(void **)&lib.freeinfo = freeinfo;
    *(void **)&lib.dupinfo = dupinfo;
    *(void **)&lib.fabric = fabric;
    *(void **)&lib.strerror = strerror_fn;
    *(void **)&lib.version = version;
    lib.abi = abi;
    lib.runtime_version = lib.version();
    uint32_t headers = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
    lib.api_version = lib.runtime_version < headers ? lib.runtime_version : headers;
    return 0;
}

/* The file the loader opened for te_fi_load (a soname resolves to a path); NULL before. */
const char *te_fi_loaded_path(void) {
    Dl_info info;
    if (!lib.version || !dladdr(*(void **)&lib.version, &info)) return NULL;
    return info.dli_fname;
}

/* 0 until te_fi_load succeeded. */
uint32_t te_fi_runtime_version(void) { return lib.runtime_version; }
uint32_t te_fi_api_version(void) { return lib.api_version; }
const char *te_fi_abi_version(void) { return lib.abi; }
uint32_t te_fi_header_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }
/* NULL before te_fi_load succeeded. */
const char *te_fi_strerror(int err) { return lib.strerror ? fi_strerror(err) : NULL; }

_Static_assert(FI_EAGAIN == 11, "FI_EAGAIN differs from the value the Rust side expects");
_Static_assert(FI_ENOSYS == 38 && FI_ENOPROTOOPT == 92 && FI_ENOKEY == 266, "errno values differ from the Rust side's");
_Static_assert(FI_EAVAIL == 259, "FI_EAVAIL differs from the value the Rust side expects");
/* Completions are read in batches of at most this many (the Rust side's CQ_BATCH). */
#define TE_CQ_BATCH 64

/* Our stable encoding of the mr_mode bits (mirrored in src/ffi.rs). */
#define TE_MR_LOCAL 1u
#define TE_MR_VIRT_ADDR 2u
#define TE_MR_PROV_KEY 4u
#define TE_MR_ENDPOINT 8u
#define TE_MR_ALLOCATED 16u
#define TE_MR_HMEM 32u

/* Step names reported when opening a rail fails (mirrored in src/ffi.rs). */
#define TE_STEP_FABRIC 1
#define TE_STEP_DOMAIN 2
#define TE_STEP_AV 3
#define TE_STEP_CQ 4
#define TE_STEP_EP 5
#define TE_STEP_BIND_AV 6
#define TE_STEP_BIND_CQ 7
#define TE_STEP_ENABLE 8

/* libfabric 2.x deprecates FI_CONTEXT (the 2.6 headers still define it, at the same bit as 1.17's);
 * 1.x providers may ask for either, so both are accepted. */
#define CONTEXT_MODES (FI_CONTEXT | FI_CONTEXT2)

static int to_fi_mr_mode(uint32_t te) {
    int m = 0;
    if (te & TE_MR_LOCAL) m |= FI_MR_LOCAL;
    if (te & TE_MR_VIRT_ADDR) m |= FI_MR_VIRT_ADDR;
    if (te & TE_MR_PROV_KEY) m |= FI_MR_PROV_KEY;
    if (te & TE_MR_ENDPOINT) m |= FI_MR_ENDPOINT;
    if (te & TE_MR_ALLOCATED) m |= FI_MR_ALLOCATED;
    if (te & TE_MR_HMEM) m |= FI_MR_HMEM;
    return m;
}

static uint32_t from_fi_mr_mode(int m) {
    uint32_t te = 0;
    if (m & FI_MR_LOCAL) te |= TE_MR_LOCAL;
    if (m & FI_MR_VIRT_ADDR) te |= TE_MR_VIRT_ADDR;
    if (m & FI_MR_PROV_KEY) te |= TE_MR_PROV_KEY;
    if (m & FI_MR_ENDPOINT) te |= TE_MR_ENDPOINT;
    if (m & FI_MR_ALLOCATED) te |= TE_MR_ALLOCATED;
    if (m & FI_MR_HMEM) te |= TE_MR_HMEM;
    return te;
}

/*
 * fi_getinfo for RDM endpoints with RMA. `prov` may be NULL (any provider). `mr_mode` is in our
 * encoding and lists every mode bit we can follow; the provider answers with the ones it needs.
 * `delivery_complete` asks for providers that honour FI_DELIVERY_COMPLETE on transmits.
 */
int te_fi_getinfo(const char *prov, uint32_t mr_mode, int delivery_complete, int hmem, struct fi_info **out) {
    if (!lib.getinfo) return -FI_ENOSYS; /* not loaded */
    struct fi_info *hints = fi_allocinfo();
    if (!hints) return -FI_ENOMEM;
    /* FI_MSG: notifications and their answers travel as messages on the same endpoint. */
    hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_MSG | FI_SEND | FI_RECV;
    if (hmem) hints->caps |= FI_HMEM;
    /* We hand every operation a 64-byte scratch area as its context, so both context modes are fine. */
    hints->mode = CONTEXT_MODES;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = to_fi_mr_mode(mr_mode);
    /* Registration and address insertion run on control threads while the owner thread posts. */
    hints->domain_attr->threading = FI_THREAD_SAFE;
    hints->domain_attr->resource_mgmt = FI_RM_ENABLED;
    hints->domain_attr->av_type = FI_AV_TABLE;
    if (delivery_complete) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    if (prov) {
        hints->fabric_attr->prov_name = strdup(prov);
        if (!hints->fabric_attr->prov_name) {
            fi_freeinfo(hints);
            return -FI_ENOMEM;
        }
    }
    int rc = fi_getinfo(lib.api_version, NULL, NULL, 0, hints, out);
    fi_freeinfo(hints);
    return rc;
}

void te_fi_freeinfo(struct fi_info *info) { fi_freeinfo(info); }
struct fi_info *te_fi_info_next(const struct fi_info *info) { return info->next; }
const char *te_fi_info_provider(const struct fi_info *info) { return info->fabric_attr->prov_name; }
const char *te_fi_info_fabric(const struct fi_info *info) { return info->fabric_attr->name; }
const char *te_fi_info_domain(const struct fi_info *info) { return info->domain_attr->name; }
uint32_t te_fi_info_mr_mode(const struct fi_info *info) { return from_fi_mr_mode(info->domain_attr->mr_mode); }
size_t te_fi_info_mr_key_size(const struct fi_info *info) { return info->domain_attr->mr_key_size; }
size_t te_fi_info_max_msg_size(const struct fi_info *info) { return info->ep_attr->max_msg_size; }
size_t te_fi_info_tx_size(const struct fi_info *info) { return info->tx_attr->size; }
int te_fi_info_is_ipv4(const struct fi_info *info) { return info->addr_format == FI_SOCKADDR_IN; }
int te_fi_info_needs_context(const struct fi_info *info) { return (info->mode & CONTEXT_MODES) != 0; }
/* 1 when the provider returned FI_HMEM in the granted caps. */
int te_fi_info_hmem(const struct fi_info *info) { return (info->caps & FI_HMEM) != 0; }

/* The objects of one rail: one NIC (domain) with one endpoint, address vector and CQ. */
struct te_fi_rail {
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    int cq_can_wait; /* the CQ has a wait object: fi_cq_sread and fi_cq_signal work */
    struct fi_info *info; /* a copy of the rail's info, its src_addr the endpoint's name (reset) */
    int deny_shm;
    size_t cq_size;
};

static void close_fid(struct fid *f) {
    if (f) fi_close(f);
}

void te_fi_rail_close(struct te_fi_rail *r) {
    close_fid(r->ep ? &r->ep->fid : NULL);
    if (r->info) fi_freeinfo(r->info);
    close_fid(r->av ? &r->av->fid : NULL);
    close_fid(r->cq ? &r->cq->fid : NULL);
    close_fid(r->domain ? &r->domain->fid : NULL);
    close_fid(r->fabric ? &r->fabric->fid : NULL);
    memset(r, 0, sizeof(*r));
}

/* Opens the rail's CQ: with a wait object where the provider has one, else without (the owner
 * thread then polls). */
static int open_cq(struct te_fi_rail *r) {
    struct fi_cq_attr cq_attr;
    memset(&cq_attr, 0, sizeof(cq_attr));
    /* MSG format: a receive's completion carries the received length. */
    cq_attr.format = FI_CQ_FORMAT_MSG;
    cq_attr.size = r->cq_size;
    cq_attr.wait_obj = FI_WAIT_UNSPEC;
    int rc = fi_cq_open(r->domain, &cq_attr, &r->cq, NULL);
    if (rc == 0) {
        r->cq_can_wait = 1;
        return 0;
    }
    cq_attr.wait_obj = FI_WAIT_NONE;
    r->cq_can_wait = 0;
    return fi_cq_open(r->domain, &cq_attr, &r->cq, NULL);
}

/* Opens the rail's endpoint on its domain, binds the AV and CQ and enables it. */
static int open_ep(struct te_fi_rail *r, struct fi_info *info, int deny_shm, int *step, int *shm_opt) {
    int rc;
    *step = TE_STEP_EP;
    if ((rc = fi_endpoint(r->domain, info, &r->ep, NULL))) return rc;
    *step = TE_STEP_BIND_AV;
    if ((rc = fi_ep_bind(r->ep, &r->av->fid, 0))) return rc;
    *step = TE_STEP_BIND_CQ;
    if ((rc = fi_ep_bind(r->ep, &r->cq->fid, FI_TRANSMIT | FI_RECV))) return rc;
    *shm_opt = 0;
    if (deny_shm) {
        /* FI_OPT_SHARED_MEMORY_PERMITTED exists from libfabric 1.18 on. */
        if (lib.runtime_version >= FI_VERSION(1, 18)) {
            bool permitted = false;
            *shm_opt = fi_setopt(&r->ep->fid, FI_OPT_ENDPOINT, FI_OPT_SHARED_MEMORY_PERMITTED, &permitted,
                                 sizeof(permitted));
        } else {
            *shm_opt = -FI_ENOSYS;
        }
    }
    *step = TE_STEP_ENABLE;
    return fi_enable(r->ep);
}

/* Opens fabric, domain, AV, CQ and endpoint for `info`. On failure returns the negative fi error,
 * stores the failed step in *step and closes what was opened. With `deny_shm`, the endpoint gets
 * FI_OPT_SHARED_MEMORY_PERMITTED = false before it is enabled; *shm_opt stores what fi_setopt said
 * (0, -FI_ENOPROTOOPT from providers without the option, -FI_ENOSYS when the library predates it),
 * and the caller decides whether that is fatal. */
int te_fi_rail_open(struct fi_info *info, size_t cq_size, int deny_shm, struct te_fi_rail *r, int *step,
                    int *shm_opt) {
    memset(r, 0, sizeof(*r));
    int rc;
    *step = TE_STEP_FABRIC;
    if ((rc = fi_fabric(info->fabric_attr, &r->fabric, NULL))) goto fail;
    *step = TE_STEP_DOMAIN;
    if ((rc = fi_domain(r->fabric, info, &r->domain, NULL))) goto fail;

    struct fi_av_attr av_attr;
    memset(&av_attr, 0, sizeof(av_attr));
    av_attr.type = FI_AV_TABLE;
    *step = TE_STEP_AV;
    if ((rc = fi_av_open(r->domain, &av_attr, &r->av, NULL))) goto fail;

    *step = TE_STEP_CQ;
    r->cq_size = cq_size;
    if ((rc = open_cq(r))) goto fail;

    if ((rc = open_ep(r, info, deny_shm, step, shm_opt))) goto fail;
    /* Keep a copy of the info whose src_addr is this endpoint's name, so a reset endpoint binds
     * the same address (the one peers know). */
    r->deny_shm = deny_shm;
    char name[512];
    size_t len = sizeof(name);
    if (fi_getname(&r->ep->fid, name, &len) == 0 && (r->info = fi_dupinfo(info)) != NULL) {
        free(r->info->src_addr);
        r->info->src_addr = malloc(len);
        if (r->info->src_addr) {
            memcpy(r->info->src_addr, name, len);
            r->info->src_addrlen = len;
        } else {
            r->info->src_addrlen = 0;
        }
    }
    return 0;
fail:
    te_fi_rail_close(r);
    return rc;
}

/* Closes only the rail's endpoint. fi_endpoint(3): operations still posted to it are discarded
 * (no completions), and the provider touches none of their buffers after fi_close returns. */
void te_fi_ep_close(struct te_fi_rail *r) {
    close_fid(r->ep ? &r->ep->fid : NULL);
    r->ep = NULL;
}

/* Closes the endpoint (see te_fi_ep_close) and its CQ, and opens new ones at the same address,
 * bound to the same AV. A fresh CQ: the old one's wait set may still refer to the closed
 * endpoint's internals (tcp;ofi_rxm 1.17 crashed in fi_cq_sread on a CQ that outlived its
 * endpoint). Returns 0 or a negative fi error (the rail then has no endpoint). The caller keeps
 * other threads off the CQ meanwhile. */
int te_fi_ep_reset(struct te_fi_rail *r) {
    te_fi_ep_close(r);
    close_fid(r->cq ? &r->cq->fid : NULL);
    r->cq = NULL;
    if (!r->info) return -FI_ENODATA;
    int rc = open_cq(r);
    if (rc) return rc;
    int step = 0, shm_opt = 0;
    return open_ep(r, r->info, r->deny_shm, &step, &shm_opt);
}

int te_fi_getname(struct te_fi_rail *r, void *buf, size_t *len) { return fi_getname(&r->ep->fid, buf, len); }

/* Inserts one address; returns 0 and the fi_addr_t, or a negative fi error. */
int te_fi_av_insert(struct te_fi_rail *r, const void *addr, uint64_t *fi_addr) {
    fi_addr_t out = FI_ADDR_NOTAVAIL;
    int n = fi_av_insert(r->av, addr, 1, &out, 0, NULL);
    if (n == 1 && out != FI_ADDR_NOTAVAIL) {
        *fi_addr = out;
        return 0;
    }
    return n < 0 ? n : -FI_EINVAL;
}

int te_fi_av_remove(struct te_fi_rail *r, uint64_t fi_addr) {
    fi_addr_t a = fi_addr;
    return fi_av_remove(r->av, &a, 1, 0);
}

/*
 * libfabric's internal "do not cache this registration" flag (include/ofi_mr.h, not installed:
 * BIT_ULL(60) from 1.17 through 2.6 and main). Utility providers pass it to their core provider
 * through fi_mr_regattr's flags (rxm registers its own buffers on verbs this way), and rxm forwards
 * an application's flags unchanged, so verbs;ofi_rxm registers the region outside verbs' MR cache
 * and fi_close deregisters it at once, even when the cache is on for the process. Only the verbs
 * core provider is given it: efa >= 2.5 rejects unknown flags, and the others have no cache.
 */
#define TE_OFI_MR_NOCACHE (1ULL << 60)

/*
 * Registers [buf, buf+len) on the rail's domain. `remote` grants peers read/write access; without it
 * the region is only usable as the local side of our own operations. `hmem_iface`/`hmem_device` are
 * 0/0 for host memory (FI_HMEM_SYSTEM). Binds to the endpoint when the provider granted
 * FI_MR_ENDPOINT. `nocache` passes TE_OFI_MR_NOCACHE (above). Returns the MR, its key (FI_KEY_NOTAVAIL becomes an error) and its descriptor.
 */
int te_fi_mr_reg(struct te_fi_rail *r, void *buf, size_t len, int remote, uint64_t requested_key, int bind_ep,
                 int nocache, int hmem_iface, int hmem_device, struct fid_mr **mr_out, uint64_t *key, void **desc) {
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_READ | FI_WRITE;
    if (remote) attr.access |= FI_REMOTE_READ | FI_REMOTE_WRITE;
    attr.requested_key = requested_key;
    attr.iface = (enum fi_hmem_iface)hmem_iface;
    attr.device.reserved = 0;
    if (hmem_iface == FI_HMEM_CUDA) attr.device.cuda = hmem_device;
    struct fid_mr *mr = NULL;
    int rc = fi_mr_regattr(r->domain, &attr, nocache ? TE_OFI_MR_NOCACHE : 0, &mr);
    if (rc) return rc;
    if (bind_ep) {
        if ((rc = fi_mr_bind(mr, &r->ep->fid, 0)) || (rc = fi_mr_enable(mr))) {
            fi_close(&mr->fid);
            return rc;
        }
    }
    uint64_t k = fi_mr_key(mr);
    if (k == FI_KEY_NOTAVAIL) {
        fi_close(&mr->fid);
        return -FI_ENOKEY;
    }
    *mr_out = mr;
    *key = k;
    *desc = fi_mr_desc(mr);
    return 0;
}

int te_fi_mr_close(struct fid_mr *mr) { return fi_close(&mr->fid); }

/* One RMA write with delivery-complete semantics: the completion means the bytes are in the
 * target's memory, not merely handed to the network. */
ssize_t te_fi_write(struct te_fi_rail *r, const void *buf, size_t len, void *desc, uint64_t dest, uint64_t raddr,
                    uint64_t rkey, void *ctx) {
    if (!r->ep) return -FI_ESHUTDOWN; /* closed by a reset that could not reopen it */
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct fi_rma_iov rma = {.addr = raddr, .len = len, .key = rkey};
    struct fi_msg_rma msg = {
        .msg_iov = &iov,
        .desc = &desc,
        .iov_count = 1,
        .addr = dest,
        .rma_iov = &rma,
        .rma_iov_count = 1,
        .context = ctx,
        .data = 0,
    };
    return fi_writemsg(r->ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
}

/* One RMA read; its completion always means the bytes are in local memory. */
ssize_t te_fi_read(struct te_fi_rail *r, void *buf, size_t len, void *desc, uint64_t dest, uint64_t raddr,
                   uint64_t rkey, void *ctx) {
    if (!r->ep) return -FI_ESHUTDOWN; /* closed by a reset that could not reopen it */
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct fi_rma_iov rma = {.addr = raddr, .len = len, .key = rkey};
    struct fi_msg_rma msg = {
        .msg_iov = &iov,
        .desc = &desc,
        .iov_count = 1,
        .addr = dest,
        .rma_iov = &rma,
        .rma_iov_count = 1,
        .context = ctx,
        .data = 0,
    };
    return fi_readmsg(r->ep, &msg, FI_COMPLETION);
}

/* Copies `n` message-format entries into the caller's context and length arrays. */
static void split_entries(const struct fi_cq_msg_entry *e, ssize_t n, void **ctxs, size_t *lens) {
    for (ssize_t i = 0; i < n; i++) {
        ctxs[i] = e[i].op_context;
        lens[i] = e[i].len;
    }
}

/* Reads up to `count` (at most TE_CQ_BATCH) completions: each one's context and, for receives, the
 * received length (0 for other operations). */
ssize_t te_fi_cq_read(struct te_fi_rail *r, void **ctxs, size_t *lens, size_t count) {
    if (!r->cq) return -FI_EAGAIN; /* a failed reset left the rail without one */
    struct fi_cq_msg_entry e[TE_CQ_BATCH];
    ssize_t n = fi_cq_read(r->cq, e, count < TE_CQ_BATCH ? count : TE_CQ_BATCH);
    if (n > 0) split_entries(e, n, ctxs, lens);
    return n;
}

/* Blocking read; only valid when the CQ has a wait object. */
ssize_t te_fi_cq_sread(struct te_fi_rail *r, void **ctxs, size_t *lens, size_t count, int timeout_ms) {
    if (!r->cq) return -FI_EAGAIN;
    struct fi_cq_msg_entry e[TE_CQ_BATCH];
    ssize_t n = fi_cq_sread(r->cq, e, count < TE_CQ_BATCH ? count : TE_CQ_BATCH, NULL, timeout_ms);
    if (n > 0) split_entries(e, n, ctxs, lens);
    return n;
}

/* Posts one receive buffer (any source). */
ssize_t te_fi_recv(struct te_fi_rail *r, void *buf, size_t len, void *desc, void *ctx) {
    if (!r->ep) return -FI_ESHUTDOWN; /* closed by a reset that could not reopen it */
    return fi_recv(r->ep, buf, len, desc, FI_ADDR_UNSPEC, ctx);
}

/* Sends one message to `dest`. Its completion only frees the buffer: answers come as messages. */
ssize_t te_fi_send(struct te_fi_rail *r, const void *buf, size_t len, void *desc, uint64_t dest, void *ctx) {
    if (!r->ep) return -FI_ESHUTDOWN; /* closed by a reset that could not reopen it */
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct fi_msg msg = {
        .msg_iov = &iov,
        .desc = &desc,
        .iov_count = 1,
        .addr = dest,
        .context = ctx,
        .data = 0,
    };
    return fi_sendmsg(r->ep, &msg, FI_COMPLETION | FI_TRANSMIT_COMPLETE);
}

int te_fi_cq_signal(struct te_fi_rail *r) { return r->cq && r->cq_can_wait ? fi_cq_signal(r->cq) : 0; }

/*
 * Reads one error completion. Fills the failed operation's context, the fi error, and the provider's
 * own text (fi_cq_strerror) into msg.
 */
ssize_t te_fi_cq_readerr(struct te_fi_rail *r, void **ctx, int *err, char *msg, size_t msg_len) {
    if (!r->cq) return -FI_EAGAIN;
    struct fi_cq_err_entry e;
    memset(&e, 0, sizeof(e));
    ssize_t rc = fi_cq_readerr(r->cq, &e, 0);
    if (rc < 0) return rc;
    *ctx = e.op_context;
    *err = e.err;
    const char *text = fi_cq_strerror(r->cq, e.prov_errno, e.err_data, NULL, 0);
    snprintf(msg, msg_len, "%s (fi error %d: %s; provider errno %d)", text ? text : "unknown", e.err,
             fi_strerror(e.err), e.prov_errno);
    return rc;
}
