// Decode-kernel harness without Python: time builds of the native paged decode kernel against
// each other, and against a bare loop that only streams the same blocks, on cold layers.
//
//   g++ -O2 -march=native -fopenmp -o /tmp/decode_harness bench/cpu_decode_harness.cpp -ldl
//   /tmp/decode_harness BATCH CONTEXT THREADS SORTED ROUNDS LIB.so|stream [LIB2.so|stream ...]
//
// LIB.so is a build of kernels/csrc (the engine's cached one is under ~/.cache/asyncpaged/kernels,
// or build a variant: g++ -O3 -shared -fPIC -fopenmp -std=c++17 -ffp-contract=fast
// -march=x86-64-v4 -DASYNCPAGED_VEC_BYTES=64 kernels/csrc/paged_decode.cpp -o v.so). "stream"
// is the bare loop: per sequence it reads the K blocks of its table, then the V blocks, with the
// kernel's prefetch (every 64-byte line of the block two ahead, prefetcht2), and does no math;
// with THREADS > 1 the sequences are dealt to the threads.
//
// Workload as in bench/cpu_attention.py: 8 query heads, 2 KV heads, head_dim 64, block 16, fp32,
// every sequence CONTEXT tokens; one shuffled pool per layer (SORTED=1: each sequence's blocks in
// physical order), enough layers for > 4x a 32 MB L3 (HOT=1 in the environment: one layer, so the
// KV stays in cache). Paths run interleaved, in alternating order, round by round; the report is
// the median (and best) per layer call. Each build runs through one decode plan made before
// the timing, as the engine makes one per step; the signatures are repeated here from
// kernels/csrc/paged_decode.cpp (asyncpaged_decode_plan_create / _run).

#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

typedef void* (*PlanCreateFn)(int64_t, int32_t, int64_t, int64_t, int64_t, int64_t,
                              const int64_t*, int64_t, int64_t, int64_t, const int64_t*,
                              const int64_t*, const int64_t*, int64_t, int64_t, float, int64_t,
                              float, int32_t*);
typedef int32_t (*PlanRunFn)(const void*, float*, int64_t, const float*, int64_t, const void*,
                             const void*, const void*, const void*, int32_t);
struct Kernel {  // a loaded build (run == nullptr: the bare stream)
  PlanCreateFn create = nullptr;
  PlanRunFn run = nullptr;
  void* plan = nullptr;
};
typedef float vf __attribute__((vector_size(64)));

constexpr int kHeads = 8, kKvHeads = 2, kHeadDim = 64, kBlock = 16;
constexpr size_t kHugePage = 2 << 20;

float* alloc_huge(size_t count) {
  const size_t bytes = (count * sizeof(float) + kHugePage - 1) / kHugePage * kHugePage;
  float* p = static_cast<float*>(aligned_alloc(kHugePage, bytes));
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

// The bare loop: the kernel's block stream and prefetch, no arithmetic but one add per line.
// With several threads, sequence s goes to thread s % threads (the kernel's lists at equal
// lengths), each thread streaming its own sequences' blocks.
float stream_layer(const char* k, const char* v, const std::vector<int64_t>& table, int batch,
                   int blocks_per_seq, size_t block_bytes, int threads) {
  float total = 0.0f;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    std::vector<const char*> blocks;
    for (int s = t; s < batch; s += threads) {
      for (int b = 0; b < blocks_per_seq; ++b)
        blocks.push_back(k + table[s * blocks_per_seq + b] * block_bytes);
      for (int b = 0; b < blocks_per_seq; ++b)
        blocks.push_back(v + table[s * blocks_per_seq + b] * block_bytes);
    }
    vf acc = {};
    for (size_t i = 0; i < blocks.size(); ++i) {
      const char* pf = i + 2 < blocks.size() ? blocks[i + 2] : nullptr;
      for (size_t off = 0; off < block_bytes; off += 64) {
        if (pf) __builtin_prefetch(pf + off, 0, 1);
        vf x;
        std::memcpy(&x, blocks[i] + off, sizeof x);
        acc += x;
      }
    }
    total += acc[0];
  }
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s BATCH CONTEXT THREADS SORTED ROUNDS LIB.so|stream ...\n",
                 argv[0]);
    return 2;
  }
  const int batch = std::atoi(argv[1]), context = std::atoi(argv[2]);
  const int threads = std::atoi(argv[3]), sorted = std::atoi(argv[4]);
  const int rounds = std::atoi(argv[5]);
  std::vector<Kernel> fns;
  std::vector<std::string> names;
  for (int i = 6; i < argc; ++i) {
    names.push_back(argv[i]);
    fns.emplace_back();
    if (names.back() == "stream") continue;
    void* lib = dlopen(argv[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      std::fprintf(stderr, "%s\n", dlerror());
      return 1;
    }
    fns.back().create = reinterpret_cast<PlanCreateFn>(dlsym(lib, "asyncpaged_decode_plan_create"));
    fns.back().run = reinterpret_cast<PlanRunFn>(dlsym(lib, "asyncpaged_decode_plan_run"));
    if (!fns.back().create || !fns.back().run) {
      std::fprintf(stderr, "%s has no decode plan entry points\n", argv[i]);
      return 1;
    }
  }
  const int blocks_per_seq = (context + kBlock - 1) / kBlock;
  const int num_blocks = batch * blocks_per_seq;
  const size_t block_elems = static_cast<size_t>(kKvHeads) * kHeadDim * kBlock;
  const size_t layer_elems = num_blocks * block_elems;
  const size_t layer_bytes = 2 * layer_elems * sizeof(float);
  const size_t cold_layers = (4ull * 32 * (1 << 20) + layer_bytes - 1) / layer_bytes;
  const int num_layers = std::getenv("HOT") ? 1 : static_cast<int>(std::max<size_t>(2, cold_layers));
  float* key = alloc_huge(layer_elems * num_layers);
  float* value = alloc_huge(layer_elems * num_layers);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < layer_elems * num_layers; ++i) {
    key[i] = normal(rng);
    value[i] = normal(rng);
  }
  std::vector<int64_t> table(num_blocks);
  for (int i = 0; i < num_blocks; ++i) table[i] = i;
  if (!sorted) std::shuffle(table.begin(), table.end(), std::mt19937(1));
  std::vector<int64_t> context_lens(batch, context);
  const size_t row = static_cast<size_t>(kHeads) * kHeadDim;
  std::vector<float> query(num_layers * batch * row), out(batch * row);
  for (float& x : query) x = normal(rng);

  for (size_t f = 0; f < fns.size(); ++f) {  // one plan per build, as the engine makes per step
    if (!fns[f].create) continue;
    int32_t status = 0;
    fns[f].plan = fns[f].create(batch, 0, num_blocks, kKvHeads, kHeadDim, kBlock, table.data(),
                                blocks_per_seq, blocks_per_seq, batch, context_lens.data(),
                                nullptr, nullptr, batch, kHeads, 0.125f, 0, 0.0f, &status);
    if (!fns[f].plan) {
      std::fprintf(stderr, "%s refused the inputs: status %d\n", names[f].c_str(), status);
      return 1;
    }
  }
  std::vector<std::vector<double>> times(fns.size());
  float sink = 0.0f;
  for (int r = 0; r <= rounds; ++r) {  // round 0 warms up
    for (size_t j = 0; j < fns.size(); ++j) {
      const size_t f = r % 2 ? fns.size() - 1 - j : j;
      const auto t0 = std::chrono::steady_clock::now();
      for (int l = 0; l < num_layers; ++l) {
        const float* k = key + l * layer_elems;
        const float* v = value + l * layer_elems;
        if (!fns[f].run) {
          sink += stream_layer(reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(v),
                               table, batch, blocks_per_seq, block_elems * sizeof(float),
                               threads);
          continue;
        }
        const int32_t status = fns[f].run(fns[f].plan, out.data(), row,
                                          query.data() + l * batch * row, row, k, v, nullptr,
                                          nullptr, threads);
        if (status != 0) {
          std::fprintf(stderr, "%s refused the inputs: status %d\n", names[f].c_str(), status);
          return 1;
        }
      }
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) times[f].push_back(seconds / num_layers);
    }
  }
  const double kv_bytes = 2.0 * batch * kKvHeads * context * kHeadDim * sizeof(float);
  for (size_t f = 0; f < fns.size(); ++f) {
    std::sort(times[f].begin(), times[f].end());
    const double median = times[f][times[f].size() / 2];
    std::printf("%3d x %-5d threads %d %-8s %-40s %8.1f us %6.1f GB/s (best %.1f us)\n", batch,
                context, threads, sorted ? "sorted" : "shuffled", names[f].c_str(), median * 1e6,
                kv_bytes / median / 1e9, times[f][0] * 1e6);
  }
  return sink == 12345.0f ? 3 : 0;  // keeps the stream's loads alive
}
