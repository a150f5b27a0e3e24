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
// A quantized cache (int8, fp8 e4m3fn / e5m2) gets codes in those layouts and a bf16 scale per
// (token, KV head) in key_scale / value_scale [num_blocks, kv_heads, block_size], computed as
// src/asyncpaged/model/kv_quant.py's quantize computes them, bit for bit for finite rows:
//
//   scale = bf16(amax(|row|) / QMAX)            (fp32 division, rounded to nearest even)
//   codes = row / (scale or 1 where it is 0)    (fp32 division), then
//           int8: rounded half to even, clamped to [-127, 127];
//           fp8:  clamped to [-QMAX, QMAX], rounded to nearest even as c10's Float8 casts do.
//
// Work decomposition: tokens, split into contiguous ranges over the threads (schedule static)
// when the step is large enough to pay for the OpenMP region; a decode step runs on the caller.
// Consecutive tokens of a prefill land in the same K columns, so a thread's scatters stay in L1.

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
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

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The largest code of each quantized dtype (kv_quant.QMAX), and fp32 -> code.
template <typename Code>
constexpr float kQmax = 0.0f;
template <>
constexpr float kQmax<int8_t> = 127.0f;
template <>
constexpr float kQmax<fp8_e4m3> = 448.0f;
template <>
constexpr float kQmax<fp8_e5m2> = 57344.0f;

template <typename Code>
inline Code encode(float x);

template <>
inline int8_t encode<int8_t>(float x) {  // round half to even (|x| < 2^22 here), then clamp
  const float magic = 12582912.0f;    // 1.5 * 2^23
  const float r = (x + magic) - magic;
  return static_cast<int8_t>(std::min(std::max(r, -127.0f), 127.0f));
}

// fp32 -> fp8 with `mant` mantissa bits, exponent bias `bias`: c10's fp8*_from_fp32_value for
// values already clamped to the finite range (the caller clamps to QMAX). Below the smallest
// normal, adding the fp32 power of two whose ulp is fp8's subnormal step lets the FPU round the
// subnormal code to nearest even (its low bits are then the code); above, the exponent is
// rebiased and the mantissa rounded to nearest even by adding half an ulp less one, plus the
// kept mantissa's lowest bit.
template <int kMant, int kBias>
inline uint8_t fp8_from_float(float x) {
  uint32_t f = bits_of(x);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  constexpr uint32_t kShift = 23 - kMant;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 - kBias + 1) << 23;
  // fp32 whose ulp is fp8's subnormal step 2^(1 - bias - mant): exponent 23 - mant + 1 - bias
  constexpr uint32_t kDenormMagic = static_cast<uint32_t>(127 + 23 - kMant + 1 - kBias) << 23;
  uint8_t code;
  if (f < kMinNormal) {
    code = static_cast<uint8_t>(bits_of(float_of(f) + float_of(kDenormMagic)) - kDenormMagic);
  } else {
    const uint32_t odd = (f >> kShift) & 1u;
    f += (static_cast<uint32_t>(kBias - 127) << 23) + ((1u << (kShift - 1)) - 1u) + odd;
    code = static_cast<uint8_t>(f >> kShift);
  }
  return static_cast<uint8_t>(code | (sign >> 24));
}

template <>
inline fp8_e4m3 encode<fp8_e4m3>(float x) {
  return fp8_e4m3{fp8_from_float<3, 7>(std::min(std::max(x, -448.0f), 448.0f))};
}

template <>
inline fp8_e5m2 encode<fp8_e5m2>(float x) {
  return fp8_e5m2{fp8_from_float<2, 15>(std::min(std::max(x, -57344.0f), 57344.0f))};
}

struct WriteParams {
  void* key_cache;
  void* value_cache;
  uint16_t* key_scale;  // quantized caches: [num_blocks, kv_heads, block_size] bf16
  uint16_t* value_scale;
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

// One row of D values quantized into codes (stride `stride`); returns its bf16 scale.
template <typename Src, typename Code>
uint16_t quantize_row(const Src* x, int64_t D, Code* out, int64_t stride) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const uint16_t scale = convert<uint16_t>(amax / kQmax<Code>);
  const float stored = to_float(scale);
  const float divisor = stored == 0.0f ? 1.0f : stored;
  for (int64_t d = 0; d < D; ++d) out[d * stride] = encode<Code>(to_float(x[d]) / divisor);
  return scale;
}

template <typename Src, typename Code>
void write_token_quantized(const WriteParams& p, int64_t t) {
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  const int64_t bs = p.block_size, D = p.head_dim, H = p.num_kv_heads;
  const int64_t block = slot / bs, offset = slot % bs;
  const Src* key = static_cast<const Src*>(p.key) + t * p.key_row_stride;
  const Src* value = static_cast<const Src*>(p.value) + t * p.value_row_stride;
  Code* kc = static_cast<Code*>(p.key_cache) + block * H * D * bs + offset;
  Code* vc = static_cast<Code*>(p.value_cache) + (block * H * bs + offset) * D;
  uint16_t* ks = p.key_scale + block * H * bs + offset;
  uint16_t* vs = p.value_scale + block * H * bs + offset;
  for (int64_t h = 0; h < H; ++h) {
    ks[h * bs] = quantize_row(key + h * D, D, kc + h * D * bs, bs);
    vs[h * bs] = quantize_row(value + h * D, D, vc + h * bs * D, 1);
  }
}

template <typename Src, typename Dst>
void write_all(const WriteParams& p, int64_t num_tokens, int num_threads) {
  const bool parallel = num_threads > 1 && num_tokens * p.num_kv_heads * p.head_dim >= kParallelElems;
  auto write = [&](int64_t t) {
    if constexpr (is_quantized_v<Dst>) {
      write_token_quantized<Src, Dst>(p, t);
    } else {
      write_token<Src, Dst>(p, t);
    }
  };
  if (!parallel) {
    for (int64_t t = 0; t < num_tokens; ++t) write(t);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < num_tokens; ++t) write(t);
}

template <typename Src>
void dispatch_cache(const WriteParams& p, int32_t cache_dtype, int64_t n, int threads) {
  switch (cache_dtype) {
    case kCacheF32: write_all<Src, float>(p, n, threads); break;
    case kCacheBf16: write_all<Src, uint16_t>(p, n, threads); break;
    case kCacheInt8: write_all<Src, int8_t>(p, n, threads); break;
    case kCacheE4m3: write_all<Src, fp8_e4m3>(p, n, threads); break;
    default: write_all<Src, fp8_e5m2>(p, n, threads); break;
  }
}

}  // namespace

extern "C" {

// Write num_tokens key/value rows into the cache; returns a Status (0 = ok, nothing written
// otherwise). key/value rows are [num_kv_heads, head_dim] contiguous with the given row strides
// (elements); cache_dtype: a CacheDtype (cpu_vec.h), with key_scale / value_scale for a
// quantized one (else null); src_dtype: 0 = fp32, 1 = bf16. Every slot is checked before any
// write.
int32_t asyncpaged_cache_write(void* key_cache, void* value_cache, void* key_scale,
                               void* value_scale, int32_t cache_dtype,
                               int64_t num_blocks, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, const void* key, int64_t key_row_stride,
                               const void* value, int64_t value_row_stride, int32_t src_dtype,
                               const int64_t* slot_mapping, int64_t num_tokens,
                               int32_t num_threads) {
  if (cache_dtype < 0 || cache_dtype >= kNumCacheDtypes || (src_dtype != 0 && src_dtype != 1))
    return kBadDtype;
  if (cache_dtype >= kCacheInt8 && (key_scale == nullptr || value_scale == nullptr))
    return kMissingScales;
  if (head_dim <= 0) return kBadHeadDim;
  if (block_size <= 0) return kBadBlockSize;
  if (num_kv_heads <= 0) return kBadHeads;
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slot_mapping[t] >= num_slots) return kBadIndex;
  const WriteParams p{key_cache,
                      value_cache,
                      static_cast<uint16_t*>(key_scale),
                      static_cast<uint16_t*>(value_scale),
                      num_kv_heads,
                      head_dim,
                      block_size,
                      key,
                      key_row_stride,
                      value,
                      value_row_stride,
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
