// The K/V cache write on the CPU: a step's new key/value rows into their slots of the paged cache.
//
// Cache layout (one layer, see src/asyncpaged/model/kv_cache.py):
//
//   key_cache   [num_blocks, kv_heads, head_dim, block_size]   K transposed per block
//   value_cache [num_blocks, kv_heads, block_size, head_dim]
//
// Token t with slot s = slot_mapping[t] >= 0 goes to block s / block_size, offset s % block_size:
// its key row [kv_heads, head_dim] is scattered down the offset's column of each head's [D, bs]
// K block (stride block_size), its value row copied into the offset's row of each V block. A
// negative slot skips the token (nothing is written). Rows are fp32 or bf16, the cache fp32 or
// bf16; fp32 -> bf16 rounds to nearest even exactly as torch's .to(torch.bfloat16) does for
// finite values (NaN stays NaN), so the cache holds the same bits as after the torch write.
//
// Work decomposition: tokens, split into contiguous ranges over the threads (schedule static)
// when the step is large enough to pay for the OpenMP region; a decode step runs on the caller.
// Consecutive tokens of a prefill land in the same K columns, so a thread's scatters stay in L1.

#include "cpu_vec.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kParallelElems = 1 << 16;  // fewer elements to write: one thread

template <typename Src, typename Dst>
inline Dst cast(Src x) {
  if constexpr (std::is_same_v<Src, Dst>) {
    return x;
  } else {
    return convert<Dst>(to_float(x));
  }
}

struct WriteParams {
  void* key_cache;
  void* value_cache;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  const void* key;
  int64_t key_row_stride;
  const void* value;
  int64_t value_row_stride;
  const int64_t* slot_mapping;
};

template <typename Src, typename Dst>
void write_token(const WriteParams& p, int64_t t) {
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  const int64_t bs = p.block_size, D = p.head_dim, H = p.num_kv_heads;
  const int64_t block = slot / bs, offset = slot % bs;
  const Src* key = static_cast<const Src*>(p.key) + t * p.key_row_stride;
  const Src* value = static_cast<const Src*>(p.value) + t * p.value_row_stride;
  Dst* kc = static_cast<Dst*>(p.key_cache) + block * H * D * bs + offset;
  Dst* vc = static_cast<Dst*>(p.value_cache) + (block * H * bs + offset) * D;
  for (int64_t h = 0; h < H; ++h) {
    const Src* k = key + h * D;
    Dst* kd = kc + h * D * bs;
    for (int64_t d = 0; d < D; ++d) kd[d * bs] = cast<Src, Dst>(k[d]);
    const Src* v = value + h * D;
    Dst* vd = vc + h * bs * D;
    if constexpr (std::is_same_v<Src, Dst>) {
      std::memcpy(vd, v, static_cast<size_t>(D) * sizeof(Dst));
    } else {
      for (int64_t d = 0; d < D; ++d) vd[d] = cast<Src, Dst>(v[d]);
    }
  }
}

template <typename Src, typename Dst>
void write_all(const WriteParams& p, int64_t num_tokens, int num_threads) {
  const bool parallel = num_threads > 1 && num_tokens * p.num_kv_heads * p.head_dim >= kParallelElems;
  if (!parallel) {
    for (int64_t t = 0; t < num_tokens; ++t) write_token<Src, Dst>(p, t);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < num_tokens; ++t) write_token<Src, Dst>(p, t);
}

template <typename Src>
void dispatch_cache(const WriteParams& p, int32_t cache_dtype, int64_t n, int threads) {
  if (cache_dtype == 0) {
    write_all<Src, float>(p, n, threads);
  } else {
    write_all<Src, uint16_t>(p, n, threads);
  }
}

}  // namespace

extern "C" {

// Write num_tokens key/value rows into the cache; returns a Status (0 = ok, nothing written
// otherwise). key/value rows are [num_kv_heads, head_dim] contiguous with the given row strides
// (elements); cache_dtype/src_dtype: 0 = fp32, 1 = bf16. Every slot is checked before any write.
int32_t asyncpaged_cache_write(void* key_cache, void* value_cache, int32_t cache_dtype,
                               int64_t num_blocks, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, const void* key, int64_t key_row_stride,
                               const void* value, int64_t value_row_stride, int32_t src_dtype,
                               const int64_t* slot_mapping, int64_t num_tokens,
                               int32_t num_threads) {
  if ((cache_dtype != 0 && cache_dtype != 1) || (src_dtype != 0 && src_dtype != 1))
    return kBadDtype;
  if (head_dim <= 0) return kBadHeadDim;
  if (block_size <= 0) return kBadBlockSize;
  if (num_kv_heads <= 0) return kBadHeads;
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slot_mapping[t] >= num_slots) return kBadIndex;
  const WriteParams p{key_cache, value_cache,    num_kv_heads,     head_dim,    block_size,
                      key,       key_row_stride, value,            value_row_stride,
                      slot_mapping};
  const int threads = num_threads < 1 ? 1 : num_threads;
  if (src_dtype == 0) {
    dispatch_cache<float>(p, cache_dtype, num_tokens, threads);
  } else {
    dispatch_cache<uint16_t>(p, cache_dtype, num_tokens, threads);
  }
  return kOk;
}

}  // extern "C"
