/* The machine's read bandwidth, without torch: is torch.sum (the bench's "one pass over that KV" column) at the
 * floor, or could a hand-written read go faster? Sums 16 arrays of 64 MiB (1 GiB, far past any cache) with AVX-512
 * loads split over OpenMP threads, plain and with software prefetch (distance 1 / 4 / 16 KiB, hint T0; 4 KiB T1).
 * Best of 5 passes, GB/s:
 *
 *     gcc -O3 -march=native -fopenmp benchmarks/cpu_read_bandwidth.c -o /tmp/bw && /tmp/bw
 *
 * Needs AVX-512 (every machine this project's CPU figures came from has it). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static float sum(const float *a, size_t n, int dist, int hint) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < n; i += 64) {
    if (dist) {
      if (hint) _mm_prefetch((const char *)(a + i + dist), _MM_HINT_T1), _mm_prefetch((const char *)(a + i + dist + 32), _MM_HINT_T1);
      else _mm_prefetch((const char *)(a + i + dist), _MM_HINT_T0), _mm_prefetch((const char *)(a + i + dist + 32), _MM_HINT_T0);
    }
    s0 = _mm512_add_ps(s0, _mm512_loadu_ps(a + i));
    s1 = _mm512_add_ps(s1, _mm512_loadu_ps(a + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_loadu_ps(a + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_loadu_ps(a + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

int main(void) {
  const size_t L = 16, n = (size_t)64 * 1024 * 1024 / 4;
  float *a[16];
  for (size_t l = 0; l < L; l++) {
    a[l] = aligned_alloc(64, n * 4 + 65536);
    for (size_t i = 0; i < n + 16384; i++) a[l][i] = 1.0f;
  }
  const int dists[] = {0, 256, 1024, 4096, 1024}, hints[] = {0, 0, 0, 0, 1};
  const char *names[] = {"plain", "prefetch T0 1 KiB", "prefetch T0 4 KiB", "prefetch T0 16 KiB", "prefetch T1 4 KiB"};
  int maxt = omp_get_max_threads();
  for (int t = 1; t <= maxt; t *= 2) {
    omp_set_num_threads(t);
    for (int m = 0; m < 5; m++) {
      double best = 1e9;
      volatile float sink = 0;
      for (int r = 0; r < 5; r++) {
        double t0 = now();
        for (size_t l = 0; l < L; l++) {
          float tot = 0;
          size_t chunk = n / (t * 16);
#pragma omp parallel for reduction(+ : tot)
          for (int c = 0; c < t * 16; c++) tot += sum(a[l] + c * chunk, chunk, dists[m], hints[m]);
          sink += tot;
        }
        double dt = now() - t0;
        if (dt < best) best = dt;
      }
      printf("threads %d  %-20s %5.1f GB/s\n", t, names[m], (double)L * n * 4 / best / 1e9);
    }
  }
  return 0;
}
