// Paged prefill attention on the CPU: a sequence's new query rows over its whole cached context.
//
// One kernel for full prefill, chunked prefill and prefix-cache hits: sequence s has q_len new
// query rows (rows query_start_loc[s] .. +q_len of the flat [T, Hq, D] query) at positions
// [ctx - q_len, ctx), ctx = context_lens[s], and its K/V for all ctx positions (cached prefix and
// the new rows, already written) are read from the paged cache:
//
//   key_cache   [num_blocks, kv_heads, head_dim, block_size]   K transposed per block
//   value_cache [num_blocks, kv_heads, block_size, head_dim]
//   key_scale, value_scale [num_blocks, kv_heads, block_size]   bf16, quantized caches only
//
// A quantized cache (int8, fp8 e4m3fn / e5m2 codes) is read as paged_decode.cpp reads it: codes
// widened in registers, a position's K scale applied to its scores, its V scale folded into its
// softmax weights after the running sum has taken them.
//
// Row at position p sees keys [window_start(p + 1), p + 1): causal, within the sliding window
// when there is one (key k visible iff k > p - window).
//
// Work item = (sequence, KV head, query tile of QT rows). The G = Hq / Hkv query heads of the KV
// head are packed with the tile's rows into M = QT * G score rows (row m = r * G + g), so every
// K/V row is loaded once per tile. Flash-style, per key tile of key_tile_blocks cache blocks:
//
//   1. scores S[M, KB] = (scale * Q) K^T, chunk by 16 positions (score_chunk in cpu_vec.h:
//      16-wide FMAs over the transposed K block, no horizontal sums);
//   2. online softmax per row over the positions it may see (softcapped first when there is a
//      cap: cap * tanh(S / cap), Gemma 2): new running max, P = exp(S - max) (0 outside the
//      row's range), running sum and output rescaled by exp(old max - new max);
//   3. O[M, D] += P V (value_rows in cpu_vec.h), the V rows of the block loaded once per tile.
//
// key_tile_blocks <= 0 makes the key tile cover the query tile's whole range: the plain two-pass
// softmax (scores of all keys, softmax, weighted V) in the same code. Measured (1 thread, 8/2
// heads x 64): 32-block key tiles run as fast as two-pass (+-2%) with bounded scratch, 1-block
// tiles take 1.45-1.55x the time; ~90 GFLOP/s on a 2048-token prompt, 2.6-7x the torch path. Only blocks holding a
// position some row of the tile may see are read, and V rows at positions >= ctx never are, so
// unwritten slots (NaN in tests) cannot leak; masked scores are replaced (select), never
// multiplied. Accumulation is fp32; bf16 storage is widened on load. Work items run under OpenMP
// (dynamic schedule, the costliest first when there are several threads); a thread's scratch
// (Q tile, O tile, S tile, row max/sum) is reused across calls.

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

struct PrefillParams {
  float* out;
  int64_t out_row_stride;
  const float* query;
  int64_t query_row_stride;
  const void* key_cache;
  const void* value_cache;
  const uint16_t* key_scale;  // quantized caches: [num_blocks, kv_heads, block_size] bf16
  const uint16_t* value_scale;
  int64_t num_kv_heads;
  int64_t block_size;
  const int64_t* block_tables;
  int64_t block_table_stride;
  const int64_t* context_lens;
  const int64_t* query_start_loc;  // [num_table_rows + 1]
  int64_t num_heads;
  float scale;
  int64_t sliding_window;   // <= 0: none
  float softcap;            // <= 0: none
  int64_t key_tile_blocks;  // cache blocks per key tile; <= 0: the query tile's whole range
};

struct Item {
  int64_t seq, head;
  int64_t q0, q1;  // the tile's query rows, relative to the sequence's first new row
  int64_t cost;    // score entries: rows x keys in range
};

struct PrefillScratch {
  std::vector<float> q, o, s;                 // [M, D], [M, D], [M, KB]
  std::vector<float> row_max, row_sum, alpha;  // [M]
};

thread_local PrefillScratch tls_prefill;

template <typename T>
inline T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Step 2 for one key tile: rows m of S [M, KB] (positions k0 + j) become P over [pv_lo, pv_hi)
// (0 where row m may not look); updates the running max/sum and sets the output rescale alpha.
// kCap: the scores row m may see are softcapped first (in place, as the max is taken); the
// others go in as 0 (they may hold anything) and are never used.
template <bool kCap>
inline void online_softmax(float* s, int M, int G, int64_t KB, int64_t k0, int64_t pv_lo,
                           int64_t pv_hi, int64_t pos0, int64_t window, float cap,
                           float* row_max, float* row_sum, float* alpha) {
  const int64_t lo_v = pv_lo / W * W, hi_v = (pv_hi + W - 1) / W * W;
  vi lane;
  for (int j = 0; j < W; ++j) lane[j] = j;
  const float inf = std::numeric_limits<float>::infinity();
  const vf neg_inf = splat(-inf);
  for (int m = 0; m < M; ++m) {
    float* sm = s + m * KB;
    const int64_t pos = pos0 + m / G;
    const int64_t a = std::max(window_start(pos + 1, window) - k0, pv_lo);
    const int64_t e = std::min(pos + 1 - k0, pv_hi);
    alpha[m] = 1.0f;
    if (a >= e) {  // nothing visible in this key tile: P = 0
      for (int64_t j = lo_v; j < hi_v; j += W) store(sm + j, vf{});
      continue;
    }
    const int32_t a32 = static_cast<int32_t>(a), e32 = static_cast<int32_t>(e);
    vf mv = neg_inf;
    for (int64_t j = a / W * W; j < e; j += W) {
      const vi idx = lane + static_cast<int32_t>(j);
      const vi valid = (idx >= a32) & (idx < e32);
      if constexpr (kCap) {
        const vf x = vsoftcap(valid ? load(sm + j) : vf{}, cap, 1.0f / cap);
        store(sm + j, x);
        mv = vmax(mv, valid ? x : neg_inf);
      } else {
        mv = vmax(mv, valid ? load(sm + j) : neg_inf);
      }
    }
    const float mx = reduce_max(mv);
    const float old_max = row_max[m];
    const float new_max = std::max(old_max, mx);
    vf acc = vf{};
    for (int64_t j = lo_v; j < hi_v; j += W) {
      const vi idx = lane + static_cast<int32_t>(j);
      const vf e_v = (idx >= a32) & (idx < e32) ? vexp(load(sm + j) - new_max) : vf{};
      store(sm + j, e_v);
      acc += e_v;
    }
    const float total = reduce_add(acc);
    if (old_max != -inf && new_max != old_max) alpha[m] = std::exp(old_max - new_max);
    row_sum[m] = row_sum[m] * alpha[m] + total;
    row_max[m] = new_max;
  }
}

template <int D, typename KV>
void prefill_tile(const PrefillParams& p, const Item& it) {
  const int64_t bs = p.block_size;
  const int G = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int64_t q_begin = p.query_start_loc[it.seq];
  const int64_t q_len = p.query_start_loc[it.seq + 1] - q_begin;
  const int64_t pos0 = p.context_lens[it.seq] - q_len + it.q0;  // position of the tile's row 0
  const int64_t rows = it.q1 - it.q0;
  const int M = static_cast<int>(rows) * G;
  const int64_t lo = window_start(pos0 + 1, p.sliding_window);  // first key any row sees
  const int64_t hi = pos0 + rows;                                // past the last key
  const int64_t first_block = lo / bs, last_block = (hi - 1) / bs;
  const int64_t tile_blocks =
      p.key_tile_blocks > 0 ? p.key_tile_blocks : last_block - first_block + 1;
  const int64_t KB = tile_blocks * bs;
  const int64_t head_elems = D * bs;
  const int64_t block_elems = p.num_kv_heads * head_elems;
  const KV* key_cache = static_cast<const KV*>(p.key_cache) + it.head * head_elems;
  const KV* value_cache = static_cast<const KV*>(p.value_cache) + it.head * head_elems;
  const int64_t* table = p.block_tables + it.seq * p.block_table_stride;
  const int64_t scale_block = p.num_kv_heads * bs;  // quantized: scales of it.head in a block
  auto k_scales = [&](int64_t b) { return p.key_scale + table[b] * scale_block + it.head * bs; };
  auto v_scales = [&](int64_t b) { return p.value_scale + table[b] * scale_block + it.head * bs; };

  PrefillScratch& scratch = tls_prefill;
  const size_t md = static_cast<size_t>(M) * D;
  float* q = grow(scratch.q, md);
  float* o = grow(scratch.o, md);
  float* s = grow(scratch.s, static_cast<size_t>(M) * static_cast<size_t>(KB));
  float* row_max = grow(scratch.row_max, static_cast<size_t>(M));
  float* row_sum = grow(scratch.row_sum, static_cast<size_t>(M));
  float* alpha = grow(scratch.alpha, static_cast<size_t>(M));
  for (int64_t r = 0; r < rows; ++r) {  // the G heads of a row are contiguous: [G, D]
    const float* src = p.query + (q_begin + it.q0 + r) * p.query_row_stride + it.head * G * D;
    for (int64_t i = 0; i < G * D; ++i) q[r * G * D + i] = src[i] * p.scale;
  }
  std::fill(o, o + md, 0.0f);
  std::fill(row_max, row_max + M, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + M, 0.0f);

  for (int64_t b0 = first_block; b0 <= last_block; b0 += tile_blocks) {
    const int64_t b1 = std::min(b0 + tile_blocks, last_block + 1);
    const int64_t k0 = b0 * bs;
    for (int64_t b = b0; b < b1; ++b) {  // 1. scores
      const KV* kb = key_cache + table[b] * block_elems;
      const KV* pf = b + kAhead <= last_block ? key_cache + table[b + kAhead] * block_elems
                                              : nullptr;
      for (int64_t c = 0; c < bs; c += kChunk) {
        const int64_t pos = b * bs + c;
        if (pos + kChunk <= lo || pos >= hi) continue;
        score_chunk_heads<D, score_tile()>(q, M, kb + c, bs, s + (pos - k0), KB,
                                           pf ? pf + c : nullptr,
                                           is_quantized_v<KV> ? k_scales(b) + c : nullptr);
      }
    }
    const int64_t pv_lo = std::max(k0, lo) - k0, pv_hi = std::min(b1 * bs, hi) - k0;
    if (p.softcap > 0.0f)  // 2.
      online_softmax<true>(s, M, G, KB, k0, pv_lo, pv_hi, pos0, p.sliding_window, p.softcap,
                           row_max, row_sum, alpha);
    else
      online_softmax<false>(s, M, G, KB, k0, pv_lo, pv_hi, pos0, p.sliding_window, 0.0f,
                            row_max, row_sum, alpha);
    for (int m = 0; m < M; ++m) {
      if (alpha[m] == 1.0f) continue;
      const vf am = splat(alpha[m]);
      for (int d = 0; d < D; d += W) store(o + m * D + d, load(o + m * D + d) * am);
    }
    for (int64_t b = b0; b < b1; ++b) {  // 3. weighted V
      const int64_t t0 = std::max<int64_t>(lo - b * bs, 0);
      const int64_t t1 = std::min<int64_t>(hi - b * bs, bs);
      if (t0 >= t1) continue;
      const KV* pf = b + kAhead <= last_block ? value_cache + table[b + kAhead] * block_elems
                                              : nullptr;
      if constexpr (is_quantized_v<KV>)
        fold_value_scales(s + (b * bs - k0), KB, M, v_scales(b), t0, t1);
      value_rows_heads<D, value_tile<D>()>(s + (b * bs - k0), KB, M,
                                           value_cache + table[b] * block_elems, t0, t1, o, pf);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    float* dst = p.out + (q_begin + it.q0 + r) * p.out_row_stride + it.head * G * D;
    for (int g = 0; g < G; ++g) {
      const int m = static_cast<int>(r) * G + g;
      const float inv = 1.0f / row_sum[m];
      for (int d = 0; d < D; ++d) dst[g * D + d] = o[m * D + d] * inv;
    }
  }
}

template <int D, typename KV>
void run_prefill(const PrefillParams& p, const std::vector<Item>& items, int num_threads) {
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t i = 0; i < n; ++i) prefill_tile<D, KV>(p, items[static_cast<size_t>(i)]);
}

template <typename KV>
int32_t dispatch_prefill(const PrefillParams& p, int64_t head_dim, const std::vector<Item>& items,
                         int num_threads) {
  switch (head_dim) {
    case 16: run_prefill<16, KV>(p, items, num_threads); return kOk;
    case 32: run_prefill<32, KV>(p, items, num_threads); return kOk;
    case 64: run_prefill<64, KV>(p, items, num_threads); return kOk;
    case 80: run_prefill<80, KV>(p, items, num_threads); return kOk;
    case 96: run_prefill<96, KV>(p, items, num_threads); return kOk;
    case 128: run_prefill<128, KV>(p, items, num_threads); return kOk;
    case 256: run_prefill<256, KV>(p, items, num_threads); return kOk;
    default: return kBadHeadDim;
  }
}

}  // namespace

extern "C" {

// Prefill attention for the sequences seq_indices[0..num_seqs) (rows of the block tables,
// context_lens and query_start_loc); returns a Status (0 = ok, nothing written otherwise).
//
// out[row, h, :] = softmax(S) V over the keys row's position sees, for every new query row of
// those sequences, S = q K^T * scale, or softcap * tanh(S / softcap) when softcap > 0 (<= 0:
// none). query/out rows are [num_heads, head_dim] contiguous with the
// given row strides (elements); kv_dtype: a CacheDtype (cpu_vec.h), key_scale / value_scale a
// quantized cache's scales (else null); query_tile: query rows per work
// item; key_tile_blocks: cache blocks per online-softmax step (<= 0: two-pass). Every index the
// kernel would follow is checked first.
int32_t asyncpaged_paged_prefill(float* out, int64_t out_row_stride, const float* query,
                                 int64_t query_row_stride, int64_t num_query_rows,
                                 const void* key_cache, const void* value_cache,
                                 const void* key_scale, const void* value_scale, int32_t kv_dtype,
                                 int64_t num_blocks, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, const int64_t* block_tables,
                                 int64_t block_table_stride, int64_t max_blocks_per_seq,
                                 int64_t num_table_rows, const int64_t* context_lens,
                                 const int64_t* query_start_loc, const int64_t* seq_indices,
                                 int64_t num_seqs, int64_t num_heads, float scale,
                                 int64_t sliding_window, float softcap, int64_t query_tile,
                                 int64_t key_tile_blocks, int32_t num_threads) {
  if (kv_dtype < 0 || kv_dtype >= kNumCacheDtypes) return kBadDtype;
  if (kv_dtype >= kCacheInt8 && (key_scale == nullptr || value_scale == nullptr))
    return kMissingScales;
  if (head_dim % W != 0) return kBadHeadDim;
  if (block_size <= 0 || block_size % kChunk != 0) return kBadBlockSize;
  if (num_kv_heads <= 0 || num_heads <= 0 || num_heads % num_kv_heads != 0) return kBadHeads;
  if (query_tile < 1) return kBadIndex;
  std::vector<Item> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t seq = seq_indices[i];
    if (seq < 0 || seq >= num_table_rows) return kBadIndex;
    const int64_t q_begin = query_start_loc[seq], q_end = query_start_loc[seq + 1];
    if (q_begin < 0 || q_end > num_query_rows || q_end <= q_begin) return kBadIndex;
    const int64_t q_len = q_end - q_begin, ctx = context_lens[seq];
    if (ctx < q_len || ctx > max_blocks_per_seq * block_size) return kBadContextLen;
    const int64_t* table = block_tables + seq * block_table_stride;
    const int64_t first = window_start(ctx - q_len + 1, sliding_window) / block_size;
    for (int64_t b = first; b <= (ctx - 1) / block_size; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return kBadBlockId;
    for (int64_t h = 0; h < num_kv_heads; ++h) {  // a head's tiles in a row: its K/V stay in L2
      for (int64_t q0 = 0; q0 < q_len; q0 += query_tile) {
        const int64_t q1 = std::min(q0 + query_tile, q_len);
        const int64_t pos0 = ctx - q_len + q0;
        const int64_t keys = pos0 + (q1 - q0) - window_start(pos0 + 1, sliding_window);
        items.push_back({seq, h, q0, q1, keys * (q1 - q0)});
      }
    }
  }
  const int threads = num_threads < 1 ? 1 : num_threads;
  if (threads > 1)  // costliest first, so the dynamic schedule ends balanced
    std::stable_sort(items.begin(), items.end(),
                     [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const PrefillParams p{out,
                        out_row_stride,
                        query,
                        query_row_stride,
                        key_cache,
                        value_cache,
                        static_cast<const uint16_t*>(key_scale),
                        static_cast<const uint16_t*>(value_scale),
                        num_kv_heads,
                        block_size,
                        block_tables,
                        block_table_stride,
                        context_lens,
                        query_start_loc,
                        num_heads,
                        scale,
                        sliding_window,
                        softcap,
                        key_tile_blocks};
  switch (kv_dtype) {
    case kCacheF32: return dispatch_prefill<float>(p, head_dim, items, threads);
    case kCacheBf16: return dispatch_prefill<uint16_t>(p, head_dim, items, threads);
    case kCacheInt8: return dispatch_prefill<int8_t>(p, head_dim, items, threads);
    case kCacheE4m3: return dispatch_prefill<fp8_e4m3>(p, head_dim, items, threads);
    case kCacheE5m2: return dispatch_prefill<fp8_e5m2>(p, head_dim, items, threads);
    default: return kBadDtype;
  }
}

}  // extern "C"
