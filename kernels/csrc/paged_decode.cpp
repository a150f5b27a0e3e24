// Paged decode attention on the CPU: one query token per sequence over the paged KV cache.
//
// Built by kernels/cpu_build.py with g++ on first use and called through ctypes
// (kernels/cpu_attention.py) by way of a plan: the tables checked and copied once, then run per
// layer with only the layer's tensors. Plain C++17 with GCC vector extensions, no intrinsics: the vector
// width comes from ASYNCPAGED_VEC_BYTES (64 for the avx512 target, 32 for avx2, 16 baseline).
//
// Cache layout (one layer, see src/asyncpaged/model/kv_cache.py):
//
//   key_cache   [num_blocks, kv_heads, head_dim, block_size]   K transposed per block
//   value_cache [num_blocks, kv_heads, block_size, head_dim]
//   key_scale, value_scale [num_blocks, kv_heads, block_size]   bf16, quantized caches only
//
// The cache holds fp32, bf16, or int8 / fp8 (e4m3fn, e5m2) codes with a scale per (token, KV
// head) (src/asyncpaged/model/kv_quant.py: a value is code * scale). Codes are widened to fp32
// in registers (cpu_vec.h); a position's K scale multiplies its score after the dot product
// (16 scales per chunk), and its V scale folds into its softmax weight before the weighted sum
// (the softmax's sum is taken first): q.(c s) = (q.c) s and p (c s) = (p s) c, the same
// attention up to fp32 rounding, with one multiply per position instead of one per element.
//
// Work item = (sequence, KV head), or (sequence, pair of KV heads) when there are enough items.
// The G = Hq / Hkv query heads of a KV head are packed, so every K/V row is loaded once for the
// whole group. Two passes over the sequence's blocks:
//
//   1. scores: for each 16-position chunk of a K block, acc[g][0..16) += q[g][d] * K[d][0..16)
//      (16-wide FMAs, no horizontal sums), into a per-thread scratch [heads, L];
//   2. softmax over the valid positions (softcapped first when there is a cap: cap * tanh(s /
//      cap), Gemma 2; then max subtracted, vectorised exp), then the weighted sum of the V rows,
//      o[g][:] += p[g][t] * V[t][:].
//
// The hardware prefetcher cannot follow a block table: the blocks are read as one stream (K
// blocks, V blocks, then the next item's K blocks) and the block two ahead in that stream is
// prefetched into L2, one cache line per row used, so the prefetches overlap the FMAs. Each
// thread runs a fixed list of items (longest first, balanced by length), so the next item is
// known. A shuffled table still reads at ~70% of sequential bandwidth (docs/tuning.md). Positions
// outside [start, context_len) are never read from V and their scores never enter the softmax,
// so unwritten slots (NaN in tests) cannot leak. Accumulation is fp32; bf16 storage is widened
// on load, int8 / fp8 codes decoded in registers. Element offsets are int64 (a cache may hold more than 2^31 elements). The vector
// helpers and the two inner loops (score_chunk, value_rows) live in cpu_vec.h.

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

namespace {

struct Params {
  float* out;
  int64_t out_row_stride;
  const float* query;
  int64_t query_row_stride;
  const void* key_cache;
  const void* value_cache;
  const uint16_t* key_scale;    // quantized caches: [num_blocks, kv_heads, block_size] bf16
  const uint16_t* value_scale;
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
  float softcap;           // <= 0: none
};

struct Scratch {  // per thread, reused across calls (OpenMP threads persist)
  std::vector<float> scores;   // [heads, L]: the query heads of one work item
  std::vector<float> q;        // [heads, D]
  std::vector<float> o;        // [heads, D]
  std::vector<float> inv_sum;  // [heads]
};

thread_local Scratch tls_scratch;

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
// kCap: the scores are softcapped first (in place, as the max is taken); positions outside
// [lo, hi) go in as 0 (their scratch may hold anything) and are never used.
template <bool kCap>
inline void softmax_rows(float* s, int G, int64_t L, int64_t lo, int64_t hi, float cap,
                         float* inv_sum) {
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
      if constexpr (kCap) {
        const vf x = vsoftcap(valid ? load(sg + j) : vf{}, cap, 1.0f / cap);
        store(sg + j, x);
        m = vmax(m, valid ? x : neg_inf);
      } else {
        m = vmax(m, valid ? load(sg + j) : neg_inf);
      }
    }
    const float mx = reduce_max(m);
    vf acc = vf{};
    for (int64_t j = lo_v; j < hi_v; j += W) {
      const vi idx = lane + static_cast<int32_t>(j);
      const vi valid = (idx >= static_cast<int32_t>(lo)) & (idx < static_cast<int32_t>(hi));
      const vf e = valid ? vexp(load(sg + j) - mx) : vf{};
      store(sg + j, e);
      acc += e;
    }
    inv_sum[g] = 1.0f / reduce_add(acc);
  }
}

// Attention of one sequence for KV heads [h0, h0 + nh). The blocks are read as one stream, K
// blocks (pass 1), then V blocks (pass 2), then the next item's K blocks (KV heads from next_h0):
// while block i of the stream is used, block i + kAhead is prefetched, spread over the FMAs.
// start_prefetched: the thread's previous item already prefetched this one's first blocks.
template <int D, typename KV>
void attend_one(const Params& p, const Span& sp, int64_t h0, int64_t nh, const Span* next,
                int64_t next_h0, bool start_prefetched) {
  const int64_t bs = p.block_size;
  const int G = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int64_t n = sp.num_blocks;
  const int64_t L = n * bs;  // scratch positions
  const int64_t head_elems = D * bs;
  const int64_t block_elems = p.num_kv_heads * head_elems;
  const KV* key_cache = static_cast<const KV*>(p.key_cache) + h0 * head_elems;
  const KV* value_cache = static_cast<const KV*>(p.value_cache) + h0 * head_elems;
  const KV* next_key_cache = static_cast<const KV*>(p.key_cache) + next_h0 * head_elems;
  auto k_block = [&](const Span& x, int64_t i) { return key_cache + x.table[i] * block_elems; };
  auto v_block = [&](int64_t i) { return value_cache + sp.table[i] * block_elems; };
  // quantized: the scales of KV head h0 in block i ([kv_heads, bs] per block)
  const int64_t scale_block = p.num_kv_heads * bs;
  auto k_scales = [&](int64_t i) { return p.key_scale + sp.table[i] * scale_block + h0 * bs; };
  auto v_scales = [&](int64_t i) { return p.value_scale + sp.table[i] * scale_block + h0 * bs; };
  auto stream_block = [&](int64_t i) -> const KV* {  // block i of the stream, or nullptr
    if (i < n) return k_block(sp, i);
    if (i < 2 * n) return v_block(i - n);
    if (next && i - 2 * n < next->num_blocks)
      return next_key_cache + next->table[i - 2 * n] * block_elems;
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
  if (!start_prefetched)
    for (int64_t b = 0; b < kAhead; ++b)
      if (const KV* first = stream_block(b)) prefetch_l2(first, nh * head_elems);
  for (int64_t b = 0; b < n; ++b) {
    const KV* pf = stream_block(b + kAhead);
    const KV* kb = k_block(sp, b);
    const uint16_t* ks = nullptr;
    if constexpr (is_quantized_v<KV>) {
      ks = k_scales(b);
      if (b + kAhead < n) __builtin_prefetch(k_scales(b + kAhead), 0, 1);
    }
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t c = 0; c < bs; c += kChunk) {
        const int64_t pos = b * bs + c;
        if (pos + kChunk <= sp.lo || pos >= sp.hi) continue;
        score_chunk_heads<D, score_tile()>(q + h * G * D, G, kb + h * head_elems + c, bs,
                                           s + h * G * L + pos, L,
                                           pf ? pf + h * head_elems + c : nullptr,
                                           ks ? ks + h * bs + c : nullptr);
      }
    }
  }

  if (p.softcap > 0.0f)
    softmax_rows<true>(s, rows, L, sp.lo, sp.hi, p.softcap, inv_sum);
  else
    softmax_rows<false>(s, rows, L, sp.lo, sp.hi, 0.0f, inv_sum);

  // Pass 2: weighted sum of the valid V rows.
  std::fill(o, o + num_q, 0.0f);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t t0 = std::max<int64_t>(sp.lo - b * bs, 0);
    const int64_t t1 = std::min<int64_t>(sp.hi - b * bs, bs);
    const KV* vb = v_block(b);
    const KV* pf = stream_block(n + b + kAhead);
    if constexpr (is_quantized_v<KV>) {
      if (b + kAhead < n) __builtin_prefetch(v_scales(b + kAhead), 0, 1);
      for (int64_t h = 0; h < nh; ++h)
        fold_value_scales(s + h * G * L + b * bs, L, G, v_scales(b) + h * bs, t0, t1);
    }
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
  // Threads get fixed lists, made longest first, each work item to the least loaded thread
  // (LPT: within 4/3 of the best balance), and run them in order, so the next item a thread
  // prefetches (see attend_one) is the one it really runs next. With dynamic scheduling the
  // next item in a shared order was usually another thread's: its prefetch was wasted and the
  // thread started each item on cold blocks.
  auto span_len = [&](int64_t i) {
    const int64_t ctx = p.context_lens[p.seq_indices ? p.seq_indices[i] : i];
    return ctx - window_start(ctx, p.sliding_window);
  };
  std::vector<int64_t> order(static_cast<size_t>(num_items));
  for (int64_t i = 0; i < num_items; ++i) order[i] = i;
  if (num_threads > 1)
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return span_len(a) > span_len(b); });
  std::vector<std::vector<int64_t>> lists(static_cast<size_t>(num_threads));
  std::vector<int64_t> load(static_cast<size_t>(num_threads), 0);
  constexpr int64_t kItemCost = 16;  // fixed cost of a work item, in positions
  for (int64_t w = 0; w < num_work; ++w) {
    const auto t = std::min_element(load.begin(), load.end()) - load.begin();
    lists[t].push_back(w);
    load[t] += span_len(order[w / groups]) + kItemCost;
  }
  auto item_span = [&](int64_t w) { return make_span(p, order[w / groups]); };
  auto run_list = [&](const std::vector<int64_t>& list) {
    for (size_t i = 0; i < list.size(); ++i) {
      const int64_t w = list[i];
      const bool has_next = i + 1 < list.size();
      const Span next = has_next ? item_span(list[i + 1]) : Span{};
      attend_one<D, KV>(p, item_span(w), (w % groups) * nh, nh, has_next ? &next : nullptr,
                        has_next ? (list[i + 1] % groups) * nh : 0, i > 0);
    }
  };
  if (num_threads == 1) {
    run_list(lists[0]);
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    // OpenMP may give fewer threads than asked for: every list still runs.
    const int nt = omp_get_num_threads();
    for (int t = omp_get_thread_num(); t < num_threads; t += nt) run_list(lists[t]);
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
    case 256: run_all<256, KV>(p, num_items, num_threads); return kOk;
    default: return kBadHeadDim;
  }
}

// Every check the kernel needs before it follows an index (Status; nothing is read otherwise).
int32_t check_decode(int32_t kv_dtype, int64_t num_blocks, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, const int64_t* block_tables, int64_t block_table_stride,
                     int64_t max_blocks_per_seq, int64_t num_table_rows,
                     const int64_t* context_lens, const int64_t* seq_indices,
                     const int64_t* query_rows, int64_t num_query_rows, int64_t num_items,
                     int64_t num_heads, int64_t sliding_window) {
  if (kv_dtype < 0 || kv_dtype >= kNumCacheDtypes) return kBadDtype;
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
  return kOk;
}

int32_t run_decode(const Params& p, int32_t kv_dtype, int64_t head_dim, int64_t num_items,
                   int32_t num_threads) {
  const int threads = num_threads < 1 ? 1 : num_threads;
  if (kv_dtype >= kCacheInt8 && (p.key_scale == nullptr || p.value_scale == nullptr))
    return kMissingScales;
  switch (kv_dtype) {
    case kCacheF32: return dispatch_head_dim<float>(p, head_dim, num_items, threads);
    case kCacheBf16: return dispatch_head_dim<uint16_t>(p, head_dim, num_items, threads);
    case kCacheInt8: return dispatch_head_dim<int8_t>(p, head_dim, num_items, threads);
    case kCacheE4m3: return dispatch_head_dim<fp8_e4m3>(p, head_dim, num_items, threads);
    case kCacheE5m2: return dispatch_head_dim<fp8_e5m2>(p, head_dim, num_items, threads);
    default: return kBadDtype;
  }
}

struct DecodePlan {
  Params params;  // per-layer pointers left null; the index pointers point into the copies
  int32_t kv_dtype;
  int64_t head_dim;
  int64_t num_items;
  std::vector<int64_t> tables;  // [num_table_rows, max_blocks_per_seq]
  std::vector<int64_t> context_lens;
  std::vector<int64_t> seq_indices;
  std::vector<int64_t> query_rows;
};

}  // namespace

extern "C" {

// The vector width this build was compiled for (tests check each target really differs).
int32_t asyncpaged_vec_bytes() { return kVecBytes; }

// Decode attention is prepared once and run many times (the engine: once per step, run per
// layer). A plan checks its arguments and copies the tables, context lengths, sequence indices
// and query rows it will read (the caller may change its tensors afterwards); it returns
// nullptr and sets *status (a Status) when a check fails.
//
// Item i is sequence seq_indices[i] (nullable: i) of the tables, reading and writing
// query/out row query_rows[i] (nullable: i): out[row, h, :] = softmax(S) V over the sequence's
// context for each query head h, S = q K^T * scale, or softcap * tanh(S / softcap) when
// softcap > 0 (<= 0: none). kv_dtype: a CacheDtype (cpu_vec.h).
void* asyncpaged_decode_plan_create(int64_t num_query_rows, int32_t kv_dtype, int64_t num_blocks,
                                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                    const int64_t* block_tables, int64_t block_table_stride,
                                    int64_t max_blocks_per_seq, int64_t num_table_rows,
                                    const int64_t* context_lens, const int64_t* seq_indices,
                                    const int64_t* query_rows, int64_t num_items,
                                    int64_t num_heads, float scale, int64_t sliding_window,
                                    float softcap, int32_t* status) {
  *status = check_decode(kv_dtype, num_blocks, num_kv_heads, head_dim, block_size, block_tables,
                         block_table_stride, max_blocks_per_seq, num_table_rows, context_lens,
                         seq_indices, query_rows, num_query_rows, num_items, num_heads,
                         sliding_window);
  if (*status != kOk) return nullptr;
  DecodePlan* plan = new DecodePlan;
  plan->kv_dtype = kv_dtype;
  plan->head_dim = head_dim;
  plan->num_items = num_items;
  for (int64_t r = 0; r < num_table_rows; ++r)
    plan->tables.insert(plan->tables.end(), block_tables + r * block_table_stride,
                        block_tables + r * block_table_stride + max_blocks_per_seq);
  plan->context_lens.assign(context_lens, context_lens + num_table_rows);
  for (int64_t i = 0; i < num_items; ++i) {
    plan->seq_indices.push_back(seq_indices ? seq_indices[i] : i);
    plan->query_rows.push_back(query_rows ? query_rows[i] : i);
  }
  plan->params = Params{nullptr, 0, nullptr, 0, nullptr, nullptr, nullptr, nullptr,
                        num_kv_heads, block_size,
                        plan->tables.data(), max_blocks_per_seq, plan->context_lens.data(),
                        plan->seq_indices.data(), plan->query_rows.data(), num_heads, scale,
                        sliding_window, softcap};
  return plan;
}

// Runs a plan on one layer: query/out rows [num_heads, head_dim] contiguous with the given row
// strides (elements), num_query_rows of them (the caller checks), caches with the plan's
// num_blocks and layout; key_scale / value_scale: a quantized cache's scales (else null).
// Returns a Status (0 = ok).
int32_t asyncpaged_decode_plan_run(const void* handle, float* out, int64_t out_row_stride,
                                   const float* query, int64_t query_row_stride,
                                   const void* key_cache, const void* value_cache,
                                   const void* key_scale, const void* value_scale,
                                   int32_t num_threads) {
  const DecodePlan& plan = *static_cast<const DecodePlan*>(handle);
  Params p = plan.params;
  p.out = out;
  p.out_row_stride = out_row_stride;
  p.query = query;
  p.query_row_stride = query_row_stride;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.key_scale = static_cast<const uint16_t*>(key_scale);
  p.value_scale = static_cast<const uint16_t*>(value_scale);
  return run_decode(p, plan.kv_dtype, plan.head_dim, plan.num_items, num_threads);
}

void asyncpaged_decode_plan_free(void* handle) { delete static_cast<DecodePlan*>(handle); }

}  // extern "C"
