/* A small thread pool for the decode kernels, whose calls last 20-500 us: handing a part to a
 * Python thread pool costs ~50 us (submit, wake, result), as much as the part itself; here a
 * worker that is waiting takes a new job within a microsecond.
 *
 * A job's range is cut into a few chunks per thread that the threads take in turn (an atomic
 * claim), so a thread that starts late or is descheduled (a VM's vCPU, another process) leaves
 * its chunks to the others instead of holding up the caller; the kernels' results do not depend
 * on how their range is cut. Waiting is bounded: a worker (and the caller, for the last chunks)
 * spins for at most SPIN_NS, then sleeps on a condition variable, so an idle pool or a machine
 * shared with other processes costs no CPU beyond that (never an unbounded spin). SPIN_NS =
 * 20 us: as fast as longer spins on the seed architecture's decode, and less in the way of
 * torch's own threads and of other processes (`benchmarks/demo_under_load.py`). A caller that
 * runs many jobs back to back with short serial work between them (a native decode step: norms,
 * attention and activation quantization between its products) holds the pool (dq_pool_hold):
 * until it lets go, waits spin for up to HOLD_NS, so no job of the step pays a wake-up (on a VM
 * a futex wake takes tens of microseconds, and a step has ~200 jobs). Jobs are run one
 * at a time (callers are serialised by a mutex); the caller takes chunks too. A forked child
 * starts with no workers (pthread_atfork) and makes its own on first use.
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
/* The bound on a wait while the pool is held: longer than any gap between a step's jobs, short
 * enough that a holder that never lets go costs no more than a millisecond a wait. */
#define HOLD_NS 1000000
/* Chunks per thread of a job (at most one a unit of its range). */
#define CHUNKS_PER_THREAD 4

/* The claim word: generation (32 bits) | threads (8) | chunks (12) | next chunk (12), so that a
 * claim is for one job's chunks and no thread can take a chunk of a job it did not see. */
#define CLAIM(gen, threads, chunks, next) \
    (((uint64_t)(gen) << 32) | ((uint64_t)(threads) << 24) | ((uint64_t)(chunks) << 12) | (next))
#define CLAIM_GEN(v) ((unsigned)((v) >> 32))
#define CLAIM_THREADS(v) ((int)(((v) >> 24) & 0xFF))
#define CLAIM_CHUNKS(v) ((int64_t)(((v) >> 12) & 0xFFF))
#define CLAIM_NEXT(v) ((int64_t)((v) & 0xFFF))

static struct {
    pthread_mutex_t run_lock;  /* one job at a time */
    pthread_mutex_t mu;
    pthread_cond_t job_cv, done_cv;
    atomic_uint generation;    /* bumped for every job */
    _Atomic uint64_t claim;    /* CLAIM(...) of the current job */
    atomic_int done;           /* its chunks finished */
    atomic_int rc;
    atomic_int hold;           /* dq_pool_hold's count */
    int workers;               /* started */
    dq_range_fn fn;
    const void *ctx;
    int64_t n;
} P = {.run_lock = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
       .job_cv = PTHREAD_COND_INITIALIZER, .done_cv = PTHREAD_COND_INITIALIZER};

/* How long a wait spins before it sleeps. */
static inline int64_t spin_ns(void) {
    return atomic_load_explicit(&P.hold, memory_order_relaxed) > 0 ? HOLD_NS : SPIN_NS;
}

/* Held (on) or let go (0): the waits of jobs spin longer while held (the header). */
void dq_pool_hold(int on) { atomic_fetch_add(&P.hold, on ? 1 : -1); }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Take and run chunks of job `gen` until none is left (thread `part`: 0 is the caller). A chunk
 * once claimed keeps its job's fn, ctx and n in place: the caller waits for every chunk. */
static void run_chunks(unsigned gen, int part) {
    uint64_t v = atomic_load_explicit(&P.claim, memory_order_acquire);
    for (;;) {
        if (CLAIM_GEN(v) != gen || part >= CLAIM_THREADS(v) || CLAIM_NEXT(v) >= CLAIM_CHUNKS(v))
            return;
        if (!atomic_compare_exchange_weak_explicit(&P.claim, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        const int64_t chunks = CLAIM_CHUNKS(v), c = CLAIM_NEXT(v);
        const int64_t lo = P.n * c / chunks, hi = P.n * (c + 1) / chunks;
        const int r = lo < hi ? P.fn(P.ctx, lo, hi) : 0;
        if (r) atomic_store(&P.rc, r);
        if (atomic_fetch_add_explicit(&P.done, 1, memory_order_acq_rel) + 1 == chunks) {
            pthread_mutex_lock(&P.mu);
            pthread_cond_signal(&P.done_cv);
            pthread_mutex_unlock(&P.mu);
        }
        v = atomic_load_explicit(&P.claim, memory_order_acquire);
    }
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
            if (++spins % 64 == 0 && now_ns() - start > spin_ns()) {
                pthread_mutex_lock(&P.mu);
                while ((g = atomic_load(&P.generation)) == seen) pthread_cond_wait(&P.job_cv, &P.mu);
                pthread_mutex_unlock(&P.mu);
                break;
            }
        }
        seen = g;
        run_chunks(g, part);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    P.workers = 0; /* the parent's workers do not exist here, nor its holds */
    atomic_store(&P.hold, 0);
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

/* fn(ctx, lo, hi) over [0, n) on `threads` threads (at most n), in chunks; returns the first
 * non-zero status of a chunk, else 0. */
int dq_parallel(dq_range_fn fn, const void *ctx, int64_t n, int threads) {
    if (threads > n) threads = (int)n;
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1) return n > 0 ? fn(ctx, 0, n) : 0;
    pthread_mutex_lock(&P.run_lock);
    start_workers(threads - 1);
    if (P.workers + 1 < threads) threads = P.workers + 1;
    const int64_t chunks = n < (int64_t)threads * CHUNKS_PER_THREAD ? n
                                                                     : threads * CHUNKS_PER_THREAD;
    P.fn = fn;
    P.ctx = ctx;
    P.n = n;
    atomic_store(&P.rc, 0);
    atomic_store(&P.done, 0);
    const unsigned gen = atomic_load(&P.generation) + 1;
    atomic_store_explicit(&P.claim, CLAIM(gen, threads, chunks, 0), memory_order_release);
    pthread_mutex_lock(&P.mu);
    atomic_store_explicit(&P.generation, gen, memory_order_release);
    pthread_cond_broadcast(&P.job_cv);
    pthread_mutex_unlock(&P.mu);
    run_chunks(gen, 0);
    const int64_t start = now_ns();
    int spins = 0;
    while (atomic_load_explicit(&P.done, memory_order_acquire) < chunks) {
        CPU_RELAX();
        if (++spins % 64 == 0 && now_ns() - start > spin_ns()) {
            pthread_mutex_lock(&P.mu);
            while (atomic_load(&P.done) < chunks) pthread_cond_wait(&P.done_cv, &P.mu);
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
