/* The CPU's peak multiply-accumulate rate for one instruction: 12 independent accumulators (more
 * than latency x issue width on current x86 cores), the same two sources, no memory traffic.
 * usage: mac_peak {vdpbf16ps|vfmadd231ps-zmm|vfmadd231ps-ymm} THREADS; prints GMAC/s.
 * Written in assembly so that no compiler keeps the accumulators in memory. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define ITERATIONS 50000000L
#define TWELVE(op, r) \
    op " %%" r "30,%%" r "31,%%" r "2\n" op " %%" r "30,%%" r "31,%%" r "3\n" \
    op " %%" r "30,%%" r "31,%%" r "4\n" op " %%" r "30,%%" r "31,%%" r "5\n" \
    op " %%" r "30,%%" r "31,%%" r "6\n" op " %%" r "30,%%" r "31,%%" r "7\n" \
    op " %%" r "30,%%" r "31,%%" r "8\n" op " %%" r "30,%%" r "31,%%" r "9\n" \
    op " %%" r "30,%%" r "31,%%" r "10\n" op " %%" r "30,%%" r "31,%%" r "11\n" \
    op " %%" r "30,%%" r "31,%%" r "12\n" op " %%" r "30,%%" r "31,%%" r "13\n"
/* ymm30/31 need AVX-512VL encodings; the AVX2 loop uses ymm14/15 instead. */
#define TWELVE_YMM(op) \
    op " %%ymm14,%%ymm15,%%ymm2\n" op " %%ymm14,%%ymm15,%%ymm3\n" op " %%ymm14,%%ymm15,%%ymm4\n" \
    op " %%ymm14,%%ymm15,%%ymm5\n" op " %%ymm14,%%ymm15,%%ymm6\n" op " %%ymm14,%%ymm15,%%ymm7\n" \
    op " %%ymm14,%%ymm15,%%ymm8\n" op " %%ymm14,%%ymm15,%%ymm9\n" op " %%ymm14,%%ymm15,%%ymm10\n" \
    op " %%ymm14,%%ymm15,%%ymm11\n" op " %%ymm14,%%ymm15,%%ymm12\n" op " %%ymm14,%%ymm15,%%ymm13\n"
#define LOOP(body, clobbers...) \
    __asm__ volatile("mov %0, %%rcx\n1:\n" body "dec %%rcx\njnz 1b\n" ::"r"(ITERATIONS) \
                     : "rcx", clobbers)

static void *bf16_zmm(void *arg) {
    (void)arg;
    LOOP(TWELVE("vdpbf16ps", "zmm"), "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
         "xmm9", "xmm10", "xmm11", "xmm12", "xmm13");
    return NULL;
}

static void *fma_zmm(void *arg) {
    (void)arg;
    LOOP(TWELVE("vfmadd231ps", "zmm"), "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
         "xmm9", "xmm10", "xmm11", "xmm12", "xmm13");
    return NULL;
}

static void *fma_ymm(void *arg) {
    (void)arg;
    LOOP(TWELVE_YMM("vfmadd231ps"), "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
         "xmm9", "xmm10", "xmm11", "xmm12", "xmm13");
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    void *(*fn)(void *) = NULL;
    double macs = 0;
    if (!strcmp(argv[1], "vdpbf16ps")) fn = bf16_zmm, macs = 32;
    if (!strcmp(argv[1], "vfmadd231ps-zmm")) fn = fma_zmm, macs = 16;
    if (!strcmp(argv[1], "vfmadd231ps-ymm")) fn = fma_ymm, macs = 8;
    int threads = 0;
    sscanf(argv[2], "%d", &threads);
    if (!fn || threads < 1 || threads > 256) return 2;
    pthread_t t[256];
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, fn, NULL);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double seconds = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    printf("%.1f\n", threads * ITERATIONS * 12 * macs / seconds / 1e9);
    return 0;
}
