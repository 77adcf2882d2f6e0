// The timing harness of the standalone tile microbenchmarks (tiles_avx2.cc, tiles_vnni.cc): variants interleaved
// round by round (drift cancels), the first round a warmup, each variant's median and minimum rate printed as a
// markdown row.  Not part of the build or of CI.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

// rounds x nf runs of run(f) (which returns the bytes it read) -> per variant, GB/s of every round but the first
template <class Run>
std::vector<std::vector<double>> interleaved_rates(int nf, int rounds, Run run) {
  std::vector<std::vector<double>> res(nf);
  for (int rep = 0; rep < rounds; ++rep)
    for (int f = 0; f < nf; ++f) {
      const auto t0 = std::chrono::steady_clock::now();
      const double bytes = run(f);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep >= 1) res[f].push_back(bytes / dt / 1e9);
    }
  return res;
}

// "| name | median | min | tokens x median |"
inline void print_rate_row(const char* name, std::vector<double> v, int tokens) {
  std::sort(v.begin(), v.end());
  printf("| %s | %.2f | %.2f | %.1f |\n", name, v[v.size() / 2], v[0], tokens * v[v.size() / 2]);
}
