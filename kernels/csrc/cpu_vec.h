// Shared pieces of the native CPU kernels: fp32 vectors (GCC vector extensions), bf16 widening,
// a vectorised exp and tanh, and the two register-tiled inner loops every attention kernel here uses:
//
//   score_chunk: s[g][0..16) = sum_d q[g][d] * K[d][0..16)   (K transposed per block: [D, bs])
//   value_rows:  o[g][:]    += sum_t p[g][t] * V[t][:]      (V rows per block: [bs, D])
//
// for a tile of GT query rows at once (every K/V row loaded once per tile). The vector width
// comes from ASYNCPAGED_VEC_BYTES (64 for the avx512 target, 32 for avx2, 16 baseline). Included
// by every .cpp in this folder (one shared library, see kernels/cpu_build.py); everything here
// has internal linkage.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#ifndef ASYNCPAGED_VEC_BYTES
#define ASYNCPAGED_VEC_BYTES 16
#endif

namespace {  // internal linkage: each translation unit has its own copy

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
  kMissingScales = 8,
};

// The cache dtypes the attention kernels and the cache write take (cpu_ops.CACHE_DTYPE_CODES).
enum CacheDtype : int32_t {
  kCacheF32 = 0,
  kCacheBf16 = 1,
  kCacheInt8 = 2,  // int8 codes with bf16 scales
  kCacheE4m3 = 3,  // fp8 e4m3fn codes with bf16 scales
  kCacheE5m2 = 4,  // fp8 e5m2 codes with bf16 scales
  kNumCacheDtypes = 5,
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

// Quantized cache codes (src/asyncpaged/model/kv_quant.py): int8, and fp8 e4m3fn / e5m2 as
// tagged bytes. load() widens W codes to fp32 without their scale (the kernels apply a token's
// scale to its score, and fold it into its softmax weight for V):
//
//   int8: sign-extended and converted;
//   fp8:  the byte sign-extended to 32 bits and shifted so its exponent and mantissa fields sit
//         at the top of fp32's (sign bit 31 kept, the copies of it masked off), then multiplied
//         by 2^(127 - bias): exact for normals and subnormals alike (an fp8 subnormal lands on an
//         fp32 subnormal, which the multiply normalizes; the kernels run with denormals on, as
//         torch leaves them). Codes with the all-ones exponent (e4m3fn's NaN 0x7f, e5m2's inf
//         and NaN) are not decoded as such: the cache write never stores them for finite rows,
//         and the kernels never use a code outside a sequence's context (poisoned memory).
struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};
static_assert(sizeof(fp8_e4m3) == 1 && sizeof(fp8_e5m2) == 1, "fp8 codes are one byte");

// W bytes at p, sign-extended to W 32-bit lanes. Intrinsics here (as quant_matmul.cpp's load_u8):
// GCC 12 lowers a byte vector's __builtin_convertvector to scalar code through general registers,
// which made the decode kernel 4x slower than over bf16.
inline vu load_codes(const void* p) {
  vu out;
#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512F__)
  const __m512i r = _mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  std::memcpy(&out, &r, sizeof out);
#elif ASYNCPAGED_VEC_BYTES == 32 && defined(__AVX2__)
  const __m256i r = _mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  std::memcpy(&out, &r, sizeof out);
#elif ASYNCPAGED_VEC_BYTES == 16 && defined(__SSE2__)
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  const __m128i x = _mm_cvtsi32_si128(v);
  const __m128i y = _mm_unpacklo_epi8(x, x);  // byte i fills lane i, then is shifted down
  const __m128i r = _mm_srai_epi32(_mm_unpacklo_epi16(y, y), 24);
  std::memcpy(&out, &r, sizeof out);
#else
  int8_t b[W];
  std::memcpy(b, p, sizeof b);
  for (int l = 0; l < W; ++l) out[l] = static_cast<uint32_t>(static_cast<int32_t>(b[l]));
#endif
  return out;
}

inline vf load(const int8_t* p) { return __builtin_convertvector((vi)load_codes(p), vf); }

inline vf load(const fp8_e4m3* p) {  // s eeee mmm -> bits 31, 23..26, 20..22
  const vu u = (load_codes(p) << 20) & 0x87f00000u;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f * 0x1p120f;
}

inline vf load(const fp8_e5m2* p) {  // s eeeee mm -> bits 31, 23..27, 21..22
  const vu u = (load_codes(p) << 21) & 0x8fe00000u;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f * 0x1p112f;
}

template <typename KV>
constexpr bool is_quantized_v = sizeof(KV) == 1;

// bf16 scalars: widening, and fp32 -> bf16 rounded to nearest even as c10::BFloat16 does (NaN
// becomes the quiet NaN 0x7fc0), so a kernel stores the bits a torch bf16 op stores.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename Dst>
inline Dst convert(float x);
template <>
inline float convert<float>(float x) {
  return x;
}
template <>
inline uint16_t convert<uint16_t>(float x) {  // round to nearest even (c10::BFloat16)
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp32 lanes rounded to the nearest bf16 (ties to even, as convert<uint16_t>), kept as fp32.
inline vf round_bf16(vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);  // all ones where v is NaN
  const vu bits = (nan & 0x7fc00000u) | (~nan & rounded);
  vf f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// W lanes stored as bf16, each rounded to nearest even.
inline void store(uint16_t* p, vf v) {
  vu u;
  const vf r = round_bf16(v);
  std::memcpy(&u, &r, sizeof u);
  const vh h = __builtin_convertvector(u >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}

// What an op of element type T stores for an fp32 result: itself (float) or its bf16 rounding.
template <typename T>
inline vf round_to(vf v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return round_bf16(v);
  } else {
    return v;
  }
}

template <typename T>
inline float round_to(float x) {
  return to_float(convert<T>(x));
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// v rotated down by S lanes (lane i <- lane (i + S) % W).
template <int S, size_t... I>
inline vf rotate(vf v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, ((I + S) % W)...);
}

// Horizontal max and sum as a tree of log2(W) shuffles: a chain of W scalar adds (3-4 cycles
// each) was half of the softmax time of a short row.
inline float reduce_max(vf v) {
  constexpr auto idx = std::make_index_sequence<W>{};
  if constexpr (W >= 16) v = vmax(v, rotate<8>(v, idx));
  if constexpr (W >= 8) v = vmax(v, rotate<4>(v, idx));
  v = vmax(v, rotate<2>(v, idx));
  v = vmax(v, rotate<1>(v, idx));
  return v[0];
}

inline float reduce_add(vf v) {
  constexpr auto idx = std::make_index_sequence<W>{};
  if constexpr (W >= 16) v += rotate<8>(v, idx);
  if constexpr (W >= 8) v += rotate<4>(v, idx);
  v += rotate<2>(v, idx);
  v += rotate<1>(v, idx);
  return v[0];
}

// The Cephes expf reduction and polynomial: x = n ln2 + r with n integral, exp(r) ~ y (~1 ulp).
// Returns y and sets n; the caller scales y by 2^n.
inline vf exp_reduced(vf x, vf& n) {
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  n = (x * 1.44269504088896341f + magic) - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * (r * r) + r + 1.0f;
}

// exp(x) for x <= 0; x below -87 gives ~1e-38, not 0.
inline vf vexp(vf x) {
  const vf lo = splat(-87.0f);
  vf n;
  const vf y = exp_reduced(x < lo ? lo : x, n);
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

// tanh(x), a few ulp over the whole float range (NaN stays NaN). |x| >= 0.3: (1 - e) / (1 + e)
// with e = exp(-2|x|) (vexp; e <= 0.55, so 1 - e loses at most a bit, and past |x| ~ 43 e is
// ~1e-38 and tanh rounds to 1); below, where 1 - e would cancel, the Taylor series to x^11
// (relative truncation error < 2e-9 at 0.3). Both are computed and one selected per lane.
inline vf vtanh(vf x) {
  const vf a = x < 0.0f ? -x : x;
  const vf e = vexp(-2.0f * a);
  const vf big = (1.0f - e) / (1.0f + e);
  const vf a2 = a * a;
  vf p = splat(-1382.0f / 155925.0f);
  p = p * a2 + 62.0f / 2835.0f;
  p = p * a2 + -17.0f / 315.0f;
  p = p * a2 + 2.0f / 15.0f;
  p = p * a2 + -1.0f / 3.0f;
  const vf small = a + a * (a2 * p);
  const vf t = a < 0.3f ? small : big;
  return x < 0.0f ? -t : t;
}

// Attention logit softcapping (Gemma 2): cap * tanh(s / cap), inv_cap = 1 / cap.
inline vf vsoftcap(vf s, float cap, float inv_cap) { return vtanh(s * inv_cap) * cap; }

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
                        const KV* pf, const uint16_t* ks) {
  constexpr int NV = kChunk / W;
  vf acc[GT][NV];
#pragma GCC unroll 16
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[g][v] = vf{};
  // one-byte codes: one prefetch per 64 bytes of rows (a row is 16 bytes at block size 16)
  const int pf_mask = is_quantized_v<KV> && bs < 64 ? static_cast<int>(64 / bs) - 1 : 0;
  for (int d = 0; d < D; ++d) {
    if (pf && (d & pf_mask) == 0) __builtin_prefetch(pf + d * bs, 0, 1);
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
  if constexpr (is_quantized_v<KV>) {  // the chunk's K scales (bf16), one per position
    vf sc[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) sc[v] = load(ks + v * W);
#pragma GCC unroll 16
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[g][v] *= sc[v];
  }
#pragma GCC unroll 16
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) store(s + g * s_stride + v * W, acc[g][v]);
}

// All G heads, in tiles of GT, GT/2, ... (G = 6 -> 4 + 2); the first tile prefetches. ks: the
// chunk's K scales in a quantized cache (ignored otherwise), applied to the scores.
template <int D, int GT, typename KV>
inline void score_chunk_heads(const float* q, int g_count, const KV* k, int64_t bs, float* s,
                              int64_t s_stride, const KV* pf, const uint16_t* ks = nullptr) {
  int g = 0;
  for (; g + GT <= g_count; g += GT, pf = nullptr)
    score_chunk<D, GT>(q + g * D, k, bs, s + g * s_stride, s_stride, pf, ks);
  if constexpr (GT > 1) {
    if (g < g_count)
      score_chunk_heads<D, GT / 2>(q + g * D, g_count - g, k, bs, s + g * s_stride, s_stride, pf,
                                   ks);
  }
}

// A quantized cache's V scales folded into the softmax weights: p[g][t] *= vs[t] for the G
// rows (stride p_stride) and the positions [t0, t1) of one block (others are never read).
inline void fold_value_scales(float* p, int64_t p_stride, int g_count, const uint16_t* vs,
                              int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + W <= t1; t += W) {
    const vf sc = load(vs + t);
    for (int g = 0; g < g_count; ++g) store(p + g * p_stride + t, load(p + g * p_stride + t) * sc);
  }
  for (; t < t1; ++t) {
    const float sc = to_float(vs[t]);
    for (int g = 0; g < g_count; ++g) p[g * p_stride + t] *= sc;
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


// The first position a query at position ctx - 1 sees with a sliding window (<= 0: none).
inline int64_t window_start(int64_t ctx, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
}

}  // namespace
