// Standalone: the memory system's streaming rate on this machine, the ceiling of a decode step's weight stream.
// One or two threads each read their own 256 MB buffer (distinct pseudo-random content on 2 MB pages: pages with
// identical content can be merged by the host, which made an earlier, unkept read of a memset buffer report
// 48-72 GB/s), loads only (two OR chains, 128 bytes an iteration), without and with a software prefetch 8 KiB ahead;
// medians of 9. Not part of the build or of CI.
//
//   g++ -O3 -march=native -std=c++17 -pthread tools/bench/mem_stream.cc -o /tmp/mem_stream && /tmp/mem_stream
//
// 2026-12-05, the AVX-512 EPYC VM (2 vCPU), six runs in 45 minutes: one thread 26-33 GB/s, two 28-59 (the second
// thread's share swings by the minute: the host's other guests).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include <sys/mman.h>
static uint8_t* alloc(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, n, MADV_HUGEPAGE);
  uint64_t x = (uint64_t)p | 1;
  uint64_t* q = (uint64_t*)p;
  for (size_t i = 0; i < n / 8; ++i) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; q[i] = x; }
  return (uint8_t*)p;
}
template <int PF>
__attribute__((noinline)) uint64_t rd(const uint8_t* p, size_t n) {
  __m512i a = _mm512_setzero_si512(), b = a;
  for (size_t i = 0; i < n; i += 128) {
    if (PF) { _mm_prefetch((const char*)p + i + PF, _MM_HINT_T0); _mm_prefetch((const char*)p + i + PF + 64, _MM_HINT_T0); }
    a = _mm512_or_si512(a, _mm512_loadu_si512(p + i));
    b = _mm512_or_si512(b, _mm512_loadu_si512(p + i + 64));
  }
  return _mm512_reduce_or_epi64(_mm512_or_si512(a, b));
}
int main(int argc, char** argv) {
  const size_t N = (size_t)256 << 20;
  uint8_t* A = alloc(N); uint8_t* B = alloc(N);
  volatile uint64_t sink = 0;
  for (int pf : {0, 8192}) for (int th : {1, 2}) {
    std::vector<double> r;
    for (int rep = 0; rep < 9; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      if (th == 1) { sink += pf ? rd<8192>(A, N) : rd<0>(A, N); sink += pf ? rd<8192>(B, N) : rd<0>(B, N); }
      else {
        std::thread t([&] { sink += pf ? rd<8192>(B, N) : rd<0>(B, N); });
        sink += pf ? rd<8192>(A, N) : rd<0>(A, N);
        t.join();
      }
      r.push_back(2.0 * N / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
    }
    std::sort(r.begin(), r.end());
    printf("threads %d prefetch %5d: median %.1f GB/s (min %.1f max %.1f)\n", th, pf, r[4], r[0], r[8]);
  }
}
