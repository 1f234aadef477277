/* A small thread pool for the decode kernels, whose calls last 20-500 us: handing a part to a
 * Python thread pool costs ~50 us (submit, wake, result), as much as the part itself; here a
 * worker that is waiting takes a new job within a microsecond.
 *
 * Waiting is bounded: a worker (and the caller, for the workers' results) spins for at most
 * SPIN_NS, then sleeps on a condition variable, so an idle pool or a machine shared with other
 * processes costs no CPU beyond that (never an unbounded spin). SPIN_NS = 20 us: as fast as longer spins on
 * the seed architecture's decode, and less in the way of torch's own threads and of other
 * processes (`benchmarks/demo_under_load.py`). Jobs are run one at a time (callers are serialised by a mutex); the caller takes part 0 itself. A forked child starts with
 * no workers (pthread_atfork) and makes its own on first use.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "pool.h"

#define MAX_WORKERS 63
#define SPIN_NS 20000

static struct {
    pthread_mutex_t run_lock;  /* one job at a time */
    pthread_mutex_t mu;
    pthread_cond_t job_cv, done_cv;
    atomic_uint generation;    /* bumped for every job */
    atomic_int pending;        /* parts not yet finished */
    atomic_int rc;
    int workers;               /* started */
    int parts;                 /* of the current job */
    dq_range_fn fn;
    const void *ctx;
    int64_t n;
} P = {.run_lock = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
       .job_cv = PTHREAD_COND_INITIALIZER, .done_cv = PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void run_part(int part) {
    const int64_t lo = P.n * part / P.parts, hi = P.n * (part + 1) / P.parts;
    const int r = lo < hi ? P.fn(P.ctx, lo, hi) : 0;
    if (r) atomic_store(&P.rc, r);
}

/* The generation each worker was started at: it may first run after the job it was started for
 * was posted, and must still take that job. */
static unsigned start_generation[MAX_WORKERS + 1];

static void *worker(void *arg) {
    const int part = (int)(intptr_t)arg;
    unsigned seen = start_generation[part];
    for (;;) {
        const int64_t start = now_ns();
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.generation, memory_order_acquire)) == seen) {
            CPU_RELAX();
            if (++spins % 64 == 0 && now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&P.mu);
                while ((g = atomic_load(&P.generation)) == seen) pthread_cond_wait(&P.job_cv, &P.mu);
                pthread_mutex_unlock(&P.mu);
                break;
            }
        }
        seen = g;
        if (part < P.parts) {
            run_part(part);
            if (atomic_fetch_sub_explicit(&P.pending, 1, memory_order_acq_rel) == 1) {
                pthread_mutex_lock(&P.mu);
                pthread_cond_signal(&P.done_cv);
                pthread_mutex_unlock(&P.mu);
            }
        }
    }
    return NULL;
}

static void after_fork_in_child(void) {
    P.workers = 0; /* the parent's workers do not exist here */
    pthread_mutex_init(&P.run_lock, NULL);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.job_cv, NULL);
    pthread_cond_init(&P.done_cv, NULL);
}

static void start_workers(int count) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        registered = 1;
    }
    while (P.workers < count) {
        start_generation[P.workers + 1] = atomic_load(&P.generation); /* before the job is posted */
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, worker, (void *)(intptr_t)(P.workers + 1)) != 0) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        P.workers++;
    }
}

/* fn(ctx, lo, hi) over [0, n) cut into `threads` parts (at most n); returns the first non-zero
 * status of a part, else 0. */
int dq_parallel(dq_range_fn fn, const void *ctx, int64_t n, int threads) {
    if (threads > n) threads = (int)n;
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1) return n > 0 ? fn(ctx, 0, n) : 0;
    pthread_mutex_lock(&P.run_lock);
    start_workers(threads - 1);
    const int parts = P.workers + 1 < threads ? P.workers + 1 : threads;
    P.fn = fn;
    P.ctx = ctx;
    P.n = n;
    P.parts = parts;
    atomic_store(&P.rc, 0);
    atomic_store(&P.pending, parts - 1);
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add_explicit(&P.generation, 1, memory_order_release);
    pthread_cond_broadcast(&P.job_cv);
    pthread_mutex_unlock(&P.mu);
    run_part(0);
    const int64_t start = now_ns();
    int spins = 0;
    while (atomic_load_explicit(&P.pending, memory_order_acquire) > 0) {
        CPU_RELAX();
        if (++spins % 64 == 0 && now_ns() - start > SPIN_NS) {
            pthread_mutex_lock(&P.mu);
            while (atomic_load(&P.pending) > 0) pthread_cond_wait(&P.done_cv, &P.mu);
            pthread_mutex_unlock(&P.mu);
        }
    }
    const int rc = atomic_load(&P.rc);
    pthread_mutex_unlock(&P.run_lock);
    return rc;
}

/* A kernel over a part of a job: the job's rows [lo, hi) (the packed tensors from row lo, y from
 * column lo), or its output's groups [lo, hi). */
typedef struct {
    const dq_job *job;
    dq_rows_kernel rows;
    dq_groups_kernel groups;
} kernel_part;

static int rows_part(const void *ctx, int64_t lo, int64_t hi) {
    const kernel_part *k = ctx;
    const dq_job *j = k->job;
    const int64_t groups = j->padded_n / j->gs, words = j->bits * j->gs / 32;
    return k->rows(j->qweight + lo * groups * words, j->scales + lo * groups,
                   j->offsets + lo * groups, hi - lo, j->padded_n, j->gs, j->bits, j->x, j->m,
                   j->y + lo, j->y_stride, j->portable);
}

static int groups_part(const void *ctx, int64_t g0, int64_t g1) {
    const kernel_part *k = ctx;
    const dq_job *j = k->job;
    return k->groups(j->qweight, j->scales, j->offsets, j->rows, j->padded_n, j->gs, j->bits, j->x,
                     j->m, g0, g1, j->y, j->portable);
}

int dq_parallel_rows(dq_rows_kernel kernel, const dq_job *j, int threads) {
    const kernel_part k = {.job = j, .rows = kernel};
    return dq_parallel(rows_part, &k, j->rows, threads);
}

int dq_parallel_groups(dq_groups_kernel kernel, const dq_job *j, int threads) {
    const kernel_part k = {.job = j, .groups = kernel};
    return dq_parallel(groups_part, &k, j->padded_n / j->gs, threads);
}
