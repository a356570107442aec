// vcpu_read_probe: how fast does each vCPU read memory, alone and together, right now? (issue 14, "the plain read")
// Build: gcc -O2 -pthread tools/vcpu_read_probe.c -o /tmp/vcpu_read_probe
// Run:   FIFO=1 ALARM=240 /tmp/vcpu_read_probe 1024 100 2    (MiB, rounds, seconds between rounds; as root)
// FIFO=1 runs the measuring threads SCHED_FIFO (priority 10) for the ~0.2 s of each round, so the other processes of
// a shared VM do not dilute the reads (every round then shows on-CPU 1.00); spin loops bail out and ALARM (seconds,
// default 300) ends the program, so a FIFO thread never lingers. Needs AVX-512F. Per round:
// vCPU0<->vCPU1 cache-line ping-pong (one-way ns, min of 3 x 2000 single round trips: ~25 ns = one CCX sharing an L3, ~70-100 ns
// = across CCDs), then 3 concurrent 2-thread reads of 1 GiB (each thread its half, pinned): per thread GB/s over its
// own wall time and its on-CPU share, their sum, and the wall rate of the whole pass (a fixed split: threads x the
// slower); then each vCPU alone (the other idle) over 512 MiB.
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static double cput(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void pin(int c) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(c, &s); sched_setaffinity(0, sizeof s, &s);
  struct sched_param sp = {.sched_priority = 10}; if (getenv("FIFO")) sched_setscheduler(0, SCHED_FIFO, &sp); }
__attribute__((target("avx512f"))) static int64_t rd(const uint8_t* q, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 256 <= n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void*)(q + i)));
    a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void*)(q + i + 64)));
    a2 = _mm512_xor_si512(a2, _mm512_load_si512((const void*)(q + i + 128)));
    a3 = _mm512_xor_si512(a3, _mm512_load_si512((const void*)(q + i + 192)));
  }
  return _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
}
static _Alignas(64) atomic_int flag; static int iters = 2000;
static void* pong(void* a) { (void)a; pin(1); for (int i = 0; i < iters; ++i) { { long g = 0; while (atomic_load(&flag) != 2*i+1) if (++g > 50000000) return NULL; } atomic_store(&flag, 2*i+2);} return NULL; }
#include <x86intrin.h>
static int spawn(pthread_t* t, int cpu, void* (*f)(void*), void* arg) {
  pthread_attr_t a; pthread_attr_init(&a); cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s);
  pthread_attr_setaffinity_np(&a, sizeof s, &s); int r = pthread_create(t, &a, f, arg); pthread_attr_destroy(&a); return r; }
static double lat(void) { pin(0); uint64_t best = ~0ull;   // min over single round trips (robust to descheduling)
  for (int t = 0; t < 3; ++t) { atomic_store(&flag, 0); pthread_t th; spawn(&th, 1, pong, NULL);
    for (int i = 0; i < iters; ++i) { uint64_t a = __rdtsc(); atomic_store(&flag, 2*i+1); long g = 0; while (atomic_load(&flag) != 2*i+2) if (++g > 50000000) break; uint64_t d = __rdtsc() - a; if (d < best) best = d; }
    pthread_join(th, NULL); }
  return best / 2.596 / 2; }   // TSC 2.596 GHz (constant_tsc); one way = round trip / 2
typedef struct { const uint8_t* p; int64_t n; int cpu; pthread_barrier_t* b; double t0, t1, ct; int64_t s; } job_t;
static void* w(void* a) { job_t* j = a; pin(j->cpu); if (j->b) pthread_barrier_wait(j->b); j->t0 = now(); double c0 = cput(); j->s = rd(j->p, j->n); j->t1 = now(); j->ct = cput() - c0; return NULL; }
int main(int argc, char** argv) {
  alarm(atoi(getenv("ALARM") ? getenv("ALARM") : "300"));
  int64_t n = (int64_t)atoi(argv[1]) << 20; int rounds = atoi(argv[2]); double sleep_s = atof(argv[3]);
  uint8_t* p = aligned_alloc(1 << 21, n);
  uint64_t x = 88172645463325252ull; for (int64_t i = 0; i < n; i += 8) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; *(uint64_t*)(p + i) = x; }
  for (int r = 0; r < rounds; ++r) {
    double l = lat(), best = 0, bt[2] = {0, 0}, bo[2] = {0, 0}, wall = 0;
    for (int k = 0; k < 3; ++k) {
      pthread_barrier_t b; pthread_barrier_init(&b, NULL, 2); pthread_t t[2]; job_t j[2];
      for (int m = 0; m < 2; ++m) { j[m] = (job_t){p + n / 2 * m, n / 2, m, &b}; spawn(&t[m], m, w, &j[m]); }
      for (int m = 0; m < 2; ++m) pthread_join(t[m], NULL);
      pthread_barrier_destroy(&b);
      double g = n / 2 / (j[0].t1 - j[0].t0) / 1e9 + n / 2 / (j[1].t1 - j[1].t0) / 1e9;
      { double a0 = j[0].t0 < j[1].t0 ? j[0].t0 : j[1].t0, e0 = j[0].t1 > j[1].t1 ? j[0].t1 : j[1].t1; if (n / (e0 - a0) / 1e9 > wall) wall = n / (e0 - a0) / 1e9; }
      if (g > best) { best = g; for (int m = 0; m < 2; ++m) { bt[m] = n / 2 / (j[m].t1 - j[m].t0) / 1e9; bo[m] = j[m].ct / (j[m].t1 - j[m].t0); } }
    }
    double al[2], ao[2];
    for (int m = 0; m < 2; ++m) { double b1 = 0, o1 = 0; for (int k = 0; k < 2; ++k) { job_t j = {p + n / 2 * m, n / 2, m, NULL}; pthread_t t; spawn(&t, m, w, &j); pthread_join(t, NULL);
        double g = n / 2 / (j.t1 - j.t0) / 1e9; if (g > b1) { b1 = g; o1 = j.ct / (j.t1 - j.t0); } } al[m] = b1; ao[m] = o1; }
    double la[3]; getloadavg(la, 3); time_t tt = time(NULL); struct tm* tm = gmtime(&tt);
    printf("%02d:%02d:%02d load %.2f | c2c %4.0f ns | together %4.1f + %4.1f = %5.1f GB/s (on-CPU %.2f %.2f; static split wall %5.1f) | alone cpu0 %4.1f (%.2f) cpu1 %4.1f (%.2f)\n",
           tm->tm_hour, tm->tm_min, tm->tm_sec, la[0], l, bt[0], bt[1], bt[0] + bt[1], bo[0], bo[1], wall, al[0], ao[0], al[1], ao[1]);
    fflush(stdout); usleep((useconds_t)(sleep_s * 1e6));
  }
}
