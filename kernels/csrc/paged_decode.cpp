// Paged decode attention on the CPU: one query token per sequence over the paged KV cache.
//
// Built by kernels/cpu_build.py with g++ on first use and called through ctypes
// (kernels/cpu_attention.py). Plain C++17 with GCC vector extensions, no intrinsics: the vector
// width comes from ASYNCPAGED_VEC_BYTES (64 for the avx512 target, 32 for avx2, 16 baseline).
//
// Cache layout (one layer, see src/asyncpaged/model/kv_cache.py):
//
//   key_cache   [num_blocks, kv_heads, head_dim, block_size]   K transposed per block
//   value_cache [num_blocks, kv_heads, block_size, head_dim]
//
// Work item = (sequence, KV head), or (sequence, pair of KV heads) when there are enough items.
// The G = Hq / Hkv query heads of a KV head are packed, so every K/V row is loaded once for the
// whole group. Two passes over the sequence's blocks:
//
//   1. scores: for each 16-position chunk of a K block, acc[g][0..16) += q[g][d] * K[d][0..16)
//      (16-wide FMAs, no horizontal sums), into a per-thread scratch [heads, L];
//   2. softmax over the valid positions (max subtracted, vectorised exp), then the weighted sum
//      of the V rows, o[g][:] += p[g][t] * V[t][:].
//
// The hardware prefetcher cannot follow a block table: the blocks are read as one stream (K
// blocks, V blocks, then the next item's K blocks) and the block two ahead in that stream is
// prefetched into L2, one cache line per row used, so the prefetches overlap the FMAs. Positions
// outside [start, context_len) are never read from V and their scores never enter the softmax,
// so unwritten slots (NaN in tests) cannot leak. Accumulation is fp32; bf16 storage is widened
// on load. Element offsets are int64 (a cache may hold more than 2^31 elements).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#ifndef ASYNCPAGED_VEC_BYTES
#define ASYNCPAGED_VEC_BYTES 16
#endif

namespace {

constexpr int kVecBytes = ASYNCPAGED_VEC_BYTES;
constexpr int W = kVecBytes / 4;               // fp32 lanes per vector
constexpr int kChunk = 16;                     // positions per K chunk (block_size % 16 == 0)
constexpr int kNumRegs = kVecBytes >= 64 ? 32 : 16;
constexpr int kMaxTile = 8;                    // most query heads per register tile
constexpr int64_t kAhead = 2;                  // prefetch distance, in blocks of the table
static_assert(kChunk % W == 0, "the vector width must divide the chunk");

typedef float vf __attribute__((vector_size(kVecBytes)));
typedef int32_t vi __attribute__((vector_size(kVecBytes)));
typedef uint32_t vu __attribute__((vector_size(kVecBytes)));
typedef uint16_t vh __attribute__((vector_size(kVecBytes / 2)));

enum Status : int32_t {
  kOk = 0,
  kBadHeadDim = 1,
  kBadBlockSize = 2,
  kBadHeads = 3,
  kBadContextLen = 4,
  kBadBlockId = 5,
  kBadDtype = 6,
  kBadIndex = 7,
};

inline vf splat(float x) { return x - vf{}; }  // x - (+0) == x exactly: folds to a broadcast

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bf16 -> fp32: the bf16 bits become the top half of each fp32 lane. At 256 and 512 bits this is
// an interleave with a zero vector (lane 2i <- 0, lane 2i+1 <- h[i]): one vpermi2w, or vpermq +
// vpunpcklwd, where __builtin_convertvector(h, vu) << 16 costs four to five shuffles. At 128
// bits GCC lowers that interleave badly, and the conversion is the better one.
template <size_t... I>
inline vf widen_bf16(vh h, std::index_sequence<I...>) {
  typedef uint16_t vh2 __attribute__((vector_size(kVecBytes)));
  const vh zero = {};
  const vh2 w = __builtin_shufflevector(zero, h, (I % 2 ? W + I / 2 : 0)...);
  vf f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

inline vf load(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  if constexpr (kVecBytes >= 32) {
    return widen_bf16(h, std::make_index_sequence<2 * W>{});
  } else {
    const vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// exp(x) for x <= 0 (Cephes expf polynomial, ~1 ulp); x below -87 gives ~1e-38, not 0.
inline vf vexp(vf x) {
  const vf lo = splat(-87.0f);
  x = x < lo ? lo : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * 1.44269504088896341f + magic) - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

constexpr int pow2_floor(int x) {
  int p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

constexpr int clamp_tile(int x) { return x < 1 ? 1 : (x > kMaxTile ? kMaxTile : pow2_floor(x)); }

// Register tiles: accumulators + one row of loads must fit the register file.
constexpr int score_tile() {
  constexpr int nv = kChunk / W;
  return clamp_tile((kNumRegs - 2 - nv) / nv);
}

template <int D>
constexpr int value_tile() {
  constexpr int nv = D / W;
  return clamp_tile((kNumRegs - 2 - nv) / nv);
}

template <typename KV>
inline void prefetch_l2(const KV* p, int64_t num_elems) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t num_bytes = num_elems * static_cast<int64_t>(sizeof(KV));
  for (int64_t off = 0; off < num_bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// s[g][0..16) = sum_d q[g][d] * k[d * bs + 0..16) for GT heads (q pre-scaled). When pf is set,
// row d of the same chunk of a block ahead is prefetched as row d is used: spread out like this,
// the prefetches overlap the FMAs instead of queueing up in one burst.
template <int D, int GT, typename KV>
inline void score_chunk(const float* q, const KV* k, int64_t bs, float* s, int64_t s_stride,
                        const KV* pf) {
  constexpr int NV = kChunk / W;
  vf acc[GT][NV];
#pragma GCC unroll 16
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[g][v] = vf{};
  for (int d = 0; d < D; ++d) {
    if (pf) __builtin_prefetch(pf + d * bs, 0, 1);
    vf kr[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) kr[v] = load(k + d * bs + v * W);
#pragma GCC unroll 16
    for (int g = 0; g < GT; ++g) {
      const vf qb = splat(q[g * D + d]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[g][v] += qb * kr[v];
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) store(s + g * s_stride + v * W, acc[g][v]);
}

// All G heads, in tiles of GT, GT/2, ... (G = 6 -> 4 + 2); the first tile prefetches.
template <int D, int GT, typename KV>
inline void score_chunk_heads(const float* q, int g_count, const KV* k, int64_t bs, float* s,
                              int64_t s_stride, const KV* pf) {
  int g = 0;
  for (; g + GT <= g_count; g += GT, pf = nullptr)
    score_chunk<D, GT>(q + g * D, k, bs, s + g * s_stride, s_stride, pf);
  if constexpr (GT > 1) {
    if (g < g_count)
      score_chunk_heads<D, GT / 2>(q + g * D, g_count - g, k, bs, s + g * s_stride, s_stride, pf);
  }
}

// o[g][:] += sum_{t in [t0, t1)} p[g][t] * v[t][:] for GT heads; row t of the block ahead
// (pf, when set) is prefetched as row t is used.
template <int D, int GT, typename KV>
inline void value_rows(const float* p, int64_t p_stride, const KV* v, int64_t t0, int64_t t1,
                       float* o, const KV* pf) {
  constexpr int NV = D / W;
  constexpr int kRowBytes = D * static_cast<int>(sizeof(KV));
  vf acc[GT][NV];
#pragma GCC unroll 16
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[g][j] = load(o + g * D + j * W);
  for (int64_t t = t0; t < t1; ++t) {
    if (pf) {
      const char* row = reinterpret_cast<const char*>(pf + t * D);
#pragma GCC unroll 8
      for (int off = 0; off < kRowBytes; off += 64) __builtin_prefetch(row + off, 0, 1);
    }
    vf vr[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) vr[j] = load(v + t * D + j * W);
#pragma GCC unroll 16
    for (int g = 0; g < GT; ++g) {
      const vf pb = splat(p[g * p_stride + t]);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[g][j] += pb * vr[j];
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) store(o + g * D + j * W, acc[g][j]);
}

template <int D, int GT, typename KV>
inline void value_rows_heads(const float* p, int64_t p_stride, int g_count, const KV* v,
                             int64_t t0, int64_t t1, float* o, const KV* pf) {
  int g = 0;
  for (; g + GT <= g_count; g += GT, pf = nullptr)
    value_rows<D, GT>(p + g * p_stride, p_stride, v, t0, t1, o + g * D, pf);
  if constexpr (GT > 1) {
    if (g < g_count)
      value_rows_heads<D, GT / 2>(p + g * p_stride, p_stride, g_count - g, v, t0, t1, o + g * D,
                                  pf);
  }
}

struct Params {
  float* out;
  int64_t out_row_stride;
  const float* query;
  int64_t query_row_stride;
  const void* key_cache;
  const void* value_cache;
  int64_t num_kv_heads;
  int64_t block_size;
  const int64_t* block_tables;
  int64_t block_table_stride;
  const int64_t* context_lens;
  const int64_t* seq_indices;  // nullable: item i is sequence i
  const int64_t* query_rows;   // nullable: item i reads query row i
  int64_t num_heads;
  float scale;
  int64_t sliding_window;  // <= 0: none
};

struct Scratch {  // per thread, reused across calls (OpenMP threads persist)
  std::vector<float> scores;   // [heads, L]: the query heads of one work item
  std::vector<float> q;        // [heads, D]
  std::vector<float> o;        // [heads, D]
  std::vector<float> inv_sum;  // [heads]
};

thread_local Scratch tls_scratch;

inline int64_t window_start(int64_t ctx, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
}

// One work item's view of the cache: the blocks it reads and the valid positions in them.
struct Span {
  int64_t row;               // query/out row
  const int64_t* table;      // block ids, from the first block holding a valid position
  int64_t num_blocks;
  int64_t lo, hi;            // valid positions [lo, hi), relative to the first block
};

inline Span make_span(const Params& p, int64_t item) {
  const int64_t seq = p.seq_indices ? p.seq_indices[item] : item;
  const int64_t bs = p.block_size;
  const int64_t ctx = p.context_lens[seq];
  const int64_t start = window_start(ctx, p.sliding_window);
  const int64_t first_block = start / bs;
  Span span;
  span.row = p.query_rows ? p.query_rows[item] : item;
  span.table = p.block_tables + seq * p.block_table_stride + first_block;
  span.num_blocks = (ctx - 1) / bs - first_block + 1;
  span.lo = start - first_block * bs;
  span.hi = ctx - first_block * bs;
  return span;
}

// Softmax over [lo, hi) of each head's row of s [G, L], in place (0 outside); returns 1 / sum
// per head in inv_sum (the normalisation is applied to the output, G * D multiplies, not G * L).
inline void softmax_rows(float* s, int G, int64_t L, int64_t lo, int64_t hi, float* inv_sum) {
  const int64_t lo_v = lo / W * W, hi_v = (hi + W - 1) / W * W;
  vi lane;
  for (int j = 0; j < W; ++j) lane[j] = j;
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * L;
    vf m = neg_inf;
    for (int64_t j = lo_v; j < hi_v; j += W) {
      const vi idx = lane + static_cast<int32_t>(j);
      const vi valid = (idx >= static_cast<int32_t>(lo)) & (idx < static_cast<int32_t>(hi));
      m = vmax(m, valid ? load(sg + j) : neg_inf);
    }
    float mx = m[0];
    for (int j = 1; j < W; ++j) mx = std::max(mx, m[j]);
    vf acc = vf{};
    for (int64_t j = lo_v; j < hi_v; j += W) {
      const vi idx = lane + static_cast<int32_t>(j);
      const vi valid = (idx >= static_cast<int32_t>(lo)) & (idx < static_cast<int32_t>(hi));
      const vf e = valid ? vexp(load(sg + j) - mx) : vf{};
      store(sg + j, e);
      acc += e;
    }
    float total = 0.0f;
    for (int j = 0; j < W; ++j) total += acc[j];
    inv_sum[g] = 1.0f / total;
  }
}

// Attention of one sequence for KV heads [h0, h0 + nh). The blocks are read as one stream, K
// blocks (pass 1), then V blocks (pass 2), then the next item's K blocks: while block i of the
// stream is used, block i + kAhead is prefetched, spread over the FMAs.
template <int D, typename KV>
void attend_one(const Params& p, const Span& sp, int64_t h0, int64_t nh, const Span* next) {
  const int64_t bs = p.block_size;
  const int G = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int64_t n = sp.num_blocks;
  const int64_t L = n * bs;  // scratch positions
  const int64_t head_elems = D * bs;
  const int64_t block_elems = p.num_kv_heads * head_elems;
  const KV* key_cache = static_cast<const KV*>(p.key_cache) + h0 * head_elems;
  const KV* value_cache = static_cast<const KV*>(p.value_cache) + h0 * head_elems;
  auto k_block = [&](const Span& x, int64_t i) { return key_cache + x.table[i] * block_elems; };
  auto v_block = [&](int64_t i) { return value_cache + sp.table[i] * block_elems; };
  auto stream_block = [&](int64_t i) -> const KV* {  // block i of the stream, or nullptr
    if (i < n) return k_block(sp, i);
    if (i < 2 * n) return v_block(i - n);
    if (next && i - 2 * n < next->num_blocks) return k_block(*next, i - 2 * n);
    return nullptr;
  };
  const int rows = static_cast<int>(nh) * G;  // query heads of this item

  Scratch& scratch = tls_scratch;
  const size_t num_scores = static_cast<size_t>(rows) * static_cast<size_t>(L);
  const size_t num_q = static_cast<size_t>(rows) * D;
  if (scratch.scores.size() < num_scores) scratch.scores.resize(num_scores);
  if (scratch.q.size() < num_q) {
    scratch.q.resize(num_q);
    scratch.o.resize(num_q);
    scratch.inv_sum.resize(static_cast<size_t>(rows));
  }
  float* s = scratch.scores.data();
  float* q = scratch.q.data();
  float* o = scratch.o.data();
  float* inv_sum = scratch.inv_sum.data();
  const float* q_src = p.query + sp.row * p.query_row_stride + h0 * G * D;
  for (size_t i = 0; i < num_q; ++i) q[i] = q_src[i] * p.scale;

  // Pass 1: scores of every chunk that holds a valid position.
  for (int64_t b = 0; b < kAhead; ++b)
    if (const KV* first = stream_block(b)) prefetch_l2(first, nh * head_elems);
  for (int64_t b = 0; b < n; ++b) {
    const KV* pf = stream_block(b + kAhead);
    const KV* kb = k_block(sp, b);
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t c = 0; c < bs; c += kChunk) {
        const int64_t pos = b * bs + c;
        if (pos + kChunk <= sp.lo || pos >= sp.hi) continue;
        score_chunk_heads<D, score_tile()>(q + h * G * D, G, kb + h * head_elems + c, bs,
                                           s + h * G * L + pos, L,
                                           pf ? pf + h * head_elems + c : nullptr);
      }
    }
  }

  softmax_rows(s, rows, L, sp.lo, sp.hi, inv_sum);

  // Pass 2: weighted sum of the valid V rows.
  std::fill(o, o + num_q, 0.0f);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t t0 = std::max<int64_t>(sp.lo - b * bs, 0);
    const int64_t t1 = std::min<int64_t>(sp.hi - b * bs, bs);
    const KV* vb = v_block(b);
    const KV* pf = stream_block(n + b + kAhead);
    for (int64_t h = 0; h < nh; ++h)
      value_rows_heads<D, value_tile<D>()>(s + h * G * L + b * bs, L, G, vb + h * head_elems,
                                           t0, t1, o + h * G * D,
                                           pf ? pf + h * head_elems : nullptr);
  }

  float* dst = p.out + sp.row * p.out_row_stride + h0 * G * D;
  for (int r = 0; r < rows; ++r)
    for (int d = 0; d < D; ++d) dst[r * D + d] = o[r * D + d] * inv_sum[r];
}

template <int D, typename KV>
void run_all(const Params& p, int64_t num_items, int num_threads) {
  // KV heads per work item: two when they pair up and that leaves >= 4 items per thread (a
  // block's KV heads are adjacent, so a pair streams 2 x head_dim x block_size in one piece:
  // measured 3-5% faster with cold KV), else one.
  const bool pairs = p.num_kv_heads % 2 == 0 && num_items * p.num_kv_heads >= 8 * num_threads;
  const int64_t nh = pairs ? 2 : 1;
  const int64_t groups = p.num_kv_heads / nh;
  const int64_t num_work = num_items * groups;
  // Longest sequences first, so dynamic scheduling ends balanced.
  std::vector<int64_t> order(static_cast<size_t>(num_items));
  for (int64_t i = 0; i < num_items; ++i) order[i] = i;
  if (num_threads > 1) {
    auto span_len = [&](int64_t i) {
      const int64_t ctx = p.context_lens[p.seq_indices ? p.seq_indices[i] : i];
      return ctx - window_start(ctx, p.sliding_window);
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return span_len(a) > span_len(b); });
  }
  auto item_span = [&](int64_t w) { return make_span(p, order[w / groups]); };
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t w = 0; w < num_work; ++w) {
    const Span sp = item_span(w);
    // The next item in the order: this thread's next one unless another thread takes it.
    const Span next = w + 1 < num_work ? item_span(w + 1) : Span{};
    attend_one<D, KV>(p, sp, (w % groups) * nh, nh, w + 1 < num_work ? &next : nullptr);
  }
}

template <typename KV>
int32_t dispatch_head_dim(const Params& p, int64_t head_dim, int64_t num_items, int num_threads) {
  switch (head_dim) {
    case 16: run_all<16, KV>(p, num_items, num_threads); return kOk;
    case 32: run_all<32, KV>(p, num_items, num_threads); return kOk;
    case 64: run_all<64, KV>(p, num_items, num_threads); return kOk;
    case 80: run_all<80, KV>(p, num_items, num_threads); return kOk;
    case 96: run_all<96, KV>(p, num_items, num_threads); return kOk;
    case 128: run_all<128, KV>(p, num_items, num_threads); return kOk;
    default: return kBadHeadDim;
  }
}

}  // namespace

extern "C" {

// The vector width this build was compiled for (tests check each target really differs).
int32_t asyncpaged_vec_bytes() { return kVecBytes; }

// Decode attention for num_items sequences; returns a Status (0 = ok, nothing written otherwise).
//
// out[query_rows[i], h, :] = softmax(q K^T * scale) V for sequence seq_indices[i], query head h.
// query/out rows are [num_heads, head_dim] contiguous with the given row strides (elements);
// kv_dtype: 0 = fp32, 1 = bf16. Every index the kernel would follow is checked first.
int32_t asyncpaged_paged_decode(float* out, int64_t out_row_stride, const float* query,
                                int64_t query_row_stride, int64_t num_query_rows,
                                const void* key_cache, const void* value_cache, int32_t kv_dtype,
                                int64_t num_blocks, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, const int64_t* block_tables,
                                int64_t block_table_stride, int64_t max_blocks_per_seq,
                                int64_t num_table_rows, const int64_t* context_lens,
                                const int64_t* seq_indices, const int64_t* query_rows,
                                int64_t num_items, int64_t num_heads, float scale,
                                int64_t sliding_window, int32_t num_threads) {
  if (kv_dtype != 0 && kv_dtype != 1) return kBadDtype;
  if (head_dim % W != 0) return kBadHeadDim;
  if (block_size <= 0 || block_size % kChunk != 0) return kBadBlockSize;
  if (num_kv_heads <= 0 || num_heads <= 0 || num_heads % num_kv_heads != 0) return kBadHeads;
  for (int64_t i = 0; i < num_items; ++i) {
    const int64_t seq = seq_indices ? seq_indices[i] : i;
    const int64_t row = query_rows ? query_rows[i] : i;
    if (seq < 0 || seq >= num_table_rows || row < 0 || row >= num_query_rows) return kBadIndex;
    const int64_t ctx = context_lens[seq];
    if (ctx < 1 || ctx > max_blocks_per_seq * block_size) return kBadContextLen;
    const int64_t first = window_start(ctx, sliding_window) / block_size;
    const int64_t* table = block_tables + seq * block_table_stride;
    for (int64_t b = first; b <= (ctx - 1) / block_size; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return kBadBlockId;
  }
  const Params p{out,          out_row_stride, query,        query_row_stride, key_cache,
                 value_cache,  num_kv_heads,   block_size,   block_tables,     block_table_stride,
                 context_lens, seq_indices,    query_rows,   num_heads,        scale,
                 sliding_window};
  const int threads = num_threads < 1 ? 1 : num_threads;
  if (kv_dtype == 0) return dispatch_head_dim<float>(p, head_dim, num_items, threads);
  return dispatch_head_dim<uint16_t>(p, head_dim, num_items, threads);
}

}  // extern "C"
