/*
 * What keeping libfabric's registration cache off costs on the verbs provider, measured without
 * our transport: the registrations the efa transport makes on a verbs rail (fi_mr_regattr with
 * remote read/write, then fi_close), with and without the OFI_MR_NOCACHE flag it passes.
 *
 * One domain of provider "verbs;ofi_rxm" (the domain named on the command line). N buffers of S
 * bytes, allocated and touched once; R rounds, each registering all N and closing all N, timed per
 * round. Round 1 is cold; from round 2 on a cache would hand back the registrations of round 1
 * (what a cache saves: registering a range again). Prints one `key=value` line per round and a
 * summary line with the median of rounds 2..R.
 *
 * Arms (one process each, so libfabric reads its environment afresh):
 *   cache off, the efa transport's default: FI_MR_CACHE_MAX_COUNT=0 in the environment and the
 *     flag on (`nocache`);
 *   cache on, libfabric's own default: nothing set, flag off (`cache`).
 *
 * Build: gcc -O1 -o verbs-mr-cache-cost scripts/verbs-mr-cache-cost.c \
 *          -Itransports/efa/libfabric/include /usr/lib/x86_64-linux-gnu/libfabric.so.1
 * Run:   FI_MR_CACHE_MAX_COUNT=0 ./verbs-mr-cache-cost nocache rxe1 256 1048576 9
 *        ./verbs-mr-cache-cost cache rxe1 256 1048576 9
 * (soft-RoCE needs FI_UNIVERSE_SIZE=16 only for endpoints; none is opened here.)
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>

/* libfabric's internal OFI_MR_NOCACHE (BIT_ULL(60) in ofi_mr.h, 1.17 through 2.6). */
#define NOCACHE_FLAG (1ULL << 60)

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void die(const char *what, int rc) {
    fprintf(stderr, "verbs-mr-cache-cost: %s: %s (%d)\n", what, fi_strerror(-rc), rc);
    exit(1);
}

int main(int argc, char **argv) {
    if (argc != 6 || (strcmp(argv[1], "cache") && strcmp(argv[1], "nocache"))) {
        fprintf(stderr, "usage: %s cache|nocache DOMAIN BUFFERS BYTES ROUNDS\n", argv[0]);
        return 2;
    }
    int nocache = !strcmp(argv[1], "nocache");
    const char *domain_name = argv[2];
    long n = atol(argv[3]), rounds = atol(argv[5]);
    size_t size = (size_t)atol(argv[4]);
    if (n <= 0 || size == 0 || rounds < 2) {
        fprintf(stderr, "verbs-mr-cache-cost: BUFFERS and BYTES must be positive, ROUNDS at least 2\n");
        return 2;
    }

    struct fi_info *hints = fi_allocinfo(), *info = NULL;
    hints->caps = FI_RMA;
    hints->ep_attr->type = FI_EP_RDM;
    hints->fabric_attr->prov_name = strdup("verbs;ofi_rxm");
    hints->domain_attr->name = strdup(domain_name);
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    int rc = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info);
    if (rc) die("fi_getinfo", rc);
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    if ((rc = fi_fabric(info->fabric_attr, &fabric, NULL))) die("fi_fabric", rc);
    if ((rc = fi_domain(fabric, info, &domain, NULL))) die("fi_domain", rc);

    char *pool = mmap(NULL, n * size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (pool == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(pool, 0x5a, n * size);
    struct fid_mr **mrs = calloc(n, sizeof(*mrs));
    double *times = calloc(rounds, sizeof(*times));
    for (long r = 0; r < rounds; r++) {
        double t0 = now_s();
        for (long i = 0; i < n; i++) {
            struct iovec iov = {.iov_base = pool + i * size, .iov_len = size};
            struct fi_mr_attr attr = {
                .mr_iov = &iov,
                .iov_count = 1,
                .access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE,
                .requested_key = (uint64_t)i,
            };
            if ((rc = fi_mr_regattr(domain, &attr, nocache ? NOCACHE_FLAG : 0, &mrs[i])))
                die("fi_mr_regattr", rc);
        }
        for (long i = 0; i < n; i++)
            if ((rc = fi_close(&mrs[i]->fid))) die("fi_close", rc);
        times[r] = now_s() - t0;
        printf("arm=%s round=%ld register_and_close_s=%.6f\n", argv[1], r + 1, times[r]);
    }
    qsort(times + 1, rounds - 1, sizeof(*times), cmp_double);
    double median = times[1 + (rounds - 2) / 2];
    printf("arm=%s buffers=%ld bytes=%zu first_round_s=%.6f median_later_round_s=%.6f "
           "per_registration_us=%.1f FI_MR_CACHE_MAX_COUNT=%s\n",
           argv[1], n, size, times[0], median, median / n * 1e6,
           getenv("FI_MR_CACHE_MAX_COUNT") ? getenv("FI_MR_CACHE_MAX_COUNT") : "(unset)");
    fi_close(&domain->fid);
    fi_close(&fabric->fid);
    fi_freeinfo(info);
    fi_freeinfo(hints);
    return 0;
}
