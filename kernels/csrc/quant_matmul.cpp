// y[M, N] = x[M, K] @ W[N, K]^T with W kept in its GGUF block layout (Q8_0, Q4_0, Q4_K, Q5_K,
// Q6_K) and x, y float32, contiguous. Weights are dequantized in registers, never as a matrix.
//
// Exactness: every weight is dequantized to the float32 value gguf-py's dequantize gives (the
// same operations in the same order: d * q, or (d * sc) * q, or (d * sc) * q - dmin * m, each
// product exact in float32), and the dot products accumulate those values in float32. So the
// result is x @ dequantize(W).T in float32 up to the summation order alone.
//
// Block layouts (little endian; fp16 = IEEE half), as llama.cpp / gguf-py:
//
//   Q8_0  34 B / 32:  d fp16 | qs int8[32]               w[i] = d * qs[i]
//   Q4_0  18 B / 32:  d fp16 | qs u8[16]     w[i] = d * (((qs[i % 16] >> 4 (i >= 16)) & 15) - 8)
//   Q4_K 144 B / 256: d | dmin | scales u8[12] | qs u8[128]; 8 sub-blocks j of 32 elements i:
//                     w = (d * sc[j]) * q - (dmin * m[j]), q = nibble j % 2 of qs[32 (j / 2) + i]
//   Q5_K 176 B / 256: d | dmin | scales u8[12] | qh u8[32] | qs u8[128]
//                     as Q4_K with q |= ((qh[i] >> j) & 1) << 4
//   Q6_K 210 B / 256: ql u8[128] | qh u8[64] | scales int8[16] | d fp16
//                     element e = 128 h + r: q = ((ql[64 h + r % 64] >> 4 (r / 64)) & 15)
//                       | (((qh[32 h + r % 32] >> 2 (r / 32)) & 3) << 4),
//                     w = (d * sc[e / 16]) * (q - 32)
//
// K-quant 6-bit scales and mins (12 bytes s): j < 4: sc = s[j] & 63, m = s[j + 4] & 63; j >= 4:
// sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4).
//
// Every type is decoded in groups of 32 elements, one W-lane vector at a time; no vector
// crosses a scale's 16 elements (W <= 16), and no load reaches past the block it decodes.
//
// Two paths (auto: gemv up to kGemvTile = 16 rows; from 17 to 32 the tiled path was 0-12%
// faster on Zen 4, and the more so the larger M):
//   gemv  (few rows, decode), in passes of at most kGemvTile rows of x:
//         one row (gemv_rows): for each row of W, one pass over its blocks, each vector of
//         weights decoded in registers and multiplied into the row (accumulators reduced
//         across lanes at the row's end); K runs in chunks whose x stays in L1 across a work
//         item's 8 rows of W.
//         two or more rows (gemv_blocked): per K chunk of 256, C = 4 rows of W are decoded
//         once into an L1 buffer (vector stores), and every R-row tile of x runs an R x C
//         register-blocked kernel over them (R + C vector loads per R C FMAs, R = 4 with 32
//         registers, 2 with 16); partial sums stay vectors until the row's end.
//   tiled (prefill): for NT = 2 W columns of y and a K chunk of 256, the W tile is decoded once
//         into an L1 buffer transposed ([k][NT]; each row's block decoded with vector stores,
//         then W x W transposes in registers), then every MT-row tile of x runs a register
//         tiled micro-kernel over it (broadcast x, FMA into MT x 2 vectors); y accumulates over
//         the chunks in k order.
// A third product, opt-in, quantizes x to int8 and sums integers (asyncpaged_quant_matmul_int8;
// see "int8 activations" below): for a few rows of x (decode; avx2 and avx512 builds) each
// row of W is streamed once, its blocks decoded in registers straight into integer dot products
// ("int8 activations, few rows"); for more rows a group of rows of W is decoded once per K
// chunk into an interleaved L1 buffer and every tile of rows of x runs over it.
// Work decomposition: rows of W (gemv) or NT-column tiles (tiled) split over the threads,
// schedule static, when the call is large enough to pay for the OpenMP region.

#include "cpu_vec.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

constexpr int kGroup = 32;                       // elements per decode group
constexpr int kVecsPerGroup = kGroup / W;
constexpr int kGemvTile = 16;  // most x rows per gemv pass
constexpr int64_t kGemvRows = 8;       // rows of W per gemv work item
constexpr int64_t kGemvFloats = 4096;  // floats of x per gemv_rows K chunk (16 KiB: half of L1)
constexpr int kBlockMin = 2;  // rows of x from which gemv blocks registers (one: gemv_rows)
constexpr int kTileCols = 2 * W;                 // NT: columns of y per tiled work item
constexpr int kTileRows = kNumRegs >= 32 ? 12 : 6;  // MT: rows of the micro-kernel
constexpr int kChunkK = 256;                     // K elements per decoded W tile
constexpr int64_t kParallelWork = 1 << 16;       // fewer weight elements x rows: one thread
constexpr int64_t kFewRowsThreadWork = 1 << 21;  // int8 few-rows kernel: per thread
static_assert(kGroup % W == 0 && 16 % W == 0, "a vector must stay inside one scale group");

enum QType : int32_t { kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };
enum Path : int32_t { kAuto = 0, kGemv = 1, kTiled = 2 };
constexpr int32_t kNoMemory = 8;  // Status: the packed copy of x could not be allocated

template <typename F, size_t... I>
[[gnu::always_inline]] inline void unrolled(F&& f, std::index_sequence<I...>) {
  (f(std::integral_constant<int, static_cast<int>(I)>{}), ...);
}

// W bytes at p, zero-extended to W int32 lanes. Intrinsics here: GCC 12 lowers a byte vector's
// __builtin_convertvector (and its shuffles with zero) to scalar code through general registers.
[[gnu::always_inline]] inline vi load_u8(const uint8_t* p) {
  vi out;
#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512F__)
  const __m512i r = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &r, sizeof out);
#elif ASYNCPAGED_VEC_BYTES == 32 && defined(__AVX2__)
  const __m256i r = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &r, sizeof out);
#elif ASYNCPAGED_VEC_BYTES == 16 && defined(__SSE2__)
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  const __m128i zero = _mm_setzero_si128();
  const __m128i r = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(v), zero), zero);
  std::memcpy(&out, &r, sizeof out);
#else
  for (int l = 0; l < W; ++l) out[l] = p[l];
#endif
  return out;
}

inline vf to_vf(vi q) { return __builtin_convertvector(q, vf); }

// IEEE half -> float, exact, in integer arithmetic (no dependence on the FPU's denormal mode).
[[gnu::always_inline]] inline float fp16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // exact for every half, subnormals included (DAZ does not apply)
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    const int shift = __builtin_clz(mant) - 21;
    mant = (mant << shift) & 0x3ffu;
    exp = static_cast<uint32_t>(1 - shift + 112);
    bits = sign | (exp << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Each type: kElems per block, kBytes per block, kGroups = kElems / kGroup, Head (the block's
// fp16 scales as float: head(block)), and group(block, head, g, out) writing elements
// [32 g, 32 g + 32) as kVecsPerGroup vectors (g a compile-time constant after unrolling).
// decode(block, f) calls f(offset, I, w) for every vector of the block: w holds elements
// [offset + I W, + W) with I a compile-time index in [0, kVecsPerGroup) and offset = 32 g.

struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34, kGroups = 1;
  struct Head { float d; };
  [[gnu::always_inline]] static inline Head head(const uint8_t* b) { return {fp16_to_float(b)}; }
  [[gnu::always_inline]] static inline void group(const uint8_t* b, Head h, int, vf* out) {
    unrolled([&](auto i) __attribute__((always_inline)) {
      constexpr int I = decltype(i)::value;
      const vi q = (load_u8(b + 2 + I * W) ^ 0x80) - 0x80;  // int8, sign-extended
      out[I] = to_vf(q) * h.d;
    }, std::make_index_sequence<kVecsPerGroup>{});
  }
  // The int8 path's integer codes of group g (see below): the weights over their float factor.
  [[gnu::always_inline]] static inline void igroup(const uint8_t* b, int, vi* out) {
    unrolled([&](auto i) __attribute__((always_inline)) {
      constexpr int I = decltype(i)::value;
      out[I] = (load_u8(b + 2 + I * W) ^ 0x80) - 0x80;
    }, std::make_index_sequence<kVecsPerGroup>{});
  }
};

struct Q4_0 {
  static constexpr int kElems = 32, kBytes = 18, kGroups = 1;
  struct Head { float d; };
  [[gnu::always_inline]] static inline Head head(const uint8_t* b) { return {fp16_to_float(b)}; }
  [[gnu::always_inline]] static inline void group(const uint8_t* b, Head h, int, vf* out) {
    unrolled([&](auto i) __attribute__((always_inline)) {
      constexpr int E = decltype(i)::value * W;
      const vi u = load_u8(b + 2 + E % 16);
      const vi q = (E >= 16 ? u >> 4 : u & 15) - 8;
      out[decltype(i)::value] = to_vf(q) * h.d;
    }, std::make_index_sequence<kVecsPerGroup>{});
  }
  [[gnu::always_inline]] static inline void igroup(const uint8_t* b, int, vi* out) {
    unrolled([&](auto i) __attribute__((always_inline)) {
      constexpr int E = decltype(i)::value * W;
      const vi u = load_u8(b + 2 + E % 16);
      out[decltype(i)::value] = (E >= 16 ? u >> 4 : u & 15) - 8;
    }, std::make_index_sequence<kVecsPerGroup>{});
  }
};

// The 6-bit scale and min of sub-block j of a K-quant block's 12 scale bytes.
[[gnu::always_inline]] inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

template <bool kHigh>  // Q4_K (kHigh false) and Q5_K (true): same scales, Q5_K adds a fifth bit
struct QK_45 {
  static constexpr int kElems = 256, kBytes = kHigh ? 176 : 144, kGroups = 8;
  struct Head { float d, dmin; };
  [[gnu::always_inline]] static inline Head head(const uint8_t* b) { return {fp16_to_float(b), fp16_to_float(b + 2)}; }
  [[gnu::always_inline]] static inline void group(const uint8_t* b, Head h, int j, vf* out) {
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + (kHigh ? 48 : 16) + 32 * (j / 2);
    int sc, m;
    scale_min_k4(b + 4, j, sc, m);
    const float dj = h.d * static_cast<float>(sc);
    const float mj = h.dmin * static_cast<float>(m);
    const int shift = 4 * (j % 2);
    unrolled([&](auto i) __attribute__((always_inline)) {
      constexpr int I = decltype(i)::value;
      vi u = (load_u8(q + I * W) >> shift) & 15;
      if constexpr (kHigh) u |= ((load_u8(qh + I * W) >> j) & 1) << 4;
      out[I] = to_vf(u) * dj - mj;  // dj * u is exact: one rounding, as gguf-py's two steps
    }, std::make_index_sequence<kVecsPerGroup>{});
  }
  // sc[j] n (the min is the int8 path's separate term)
  [[gnu::always_inline]] static inline void igroup(const uint8_t* b, int j, vi* out) {
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + (kHigh ? 48 : 16) + 32 * (j / 2);
    int sc, m;
    scale_min_k4(b + 4, j, sc, m);
    const int shift = 4 * (j % 2);
    unrolled([&](auto i) __attribute__((always_inline)) {
      constexpr int I = decltype(i)::value;
      vi u = (load_u8(q + I * W) >> shift) & 15;
      if constexpr (kHigh) u |= ((load_u8(qh + I * W) >> j) & 1) << 4;
      out[I] = u * sc;
    }, std::make_index_sequence<kVecsPerGroup>{});
  }
};
using Q4_K = QK_45<false>;
using Q5_K = QK_45<true>;

struct Q6_K {
  static constexpr int kElems = 256, kBytes = 210, kGroups = 8;
  struct Head { float d; };
  [[gnu::always_inline]] static inline Head head(const uint8_t* b) { return {fp16_to_float(b + 208)}; }
  // group g: elements 32 g .. + 32 (h = g / 4, r = 32 (g % 4))
  [[gnu::always_inline]] static inline void group(const uint8_t* b, Head h, int g, vf* out) {
    const uint8_t* lo = b + 64 * (g / 4) + 32 * (g % 2);
    const int lo_shift = 4 * ((g % 4) / 2);
    const uint8_t* hi = b + 128 + 32 * (g / 4);
    const int hi_shift = 2 * (g % 4);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    unrolled([&](auto i) __attribute__((always_inline)) {
      constexpr int I = decltype(i)::value;
      const float ds = h.d * static_cast<float>(scales[2 * g + (I * W) / 16]);
      const vi q = (((load_u8(lo + I * W) >> lo_shift) & 15)
                    | (((load_u8(hi + I * W) >> hi_shift) & 3) << 4)) - 32;
      out[I] = to_vf(q) * ds;
    }, std::make_index_sequence<kVecsPerGroup>{});
  }
  [[gnu::always_inline]] static inline void igroup(const uint8_t* b, int g, vi* out) {
    const uint8_t* lo = b + 64 * (g / 4) + 32 * (g % 2);
    const int lo_shift = 4 * ((g % 4) / 2);
    const uint8_t* hi = b + 128 + 32 * (g / 4);
    const int hi_shift = 2 * (g % 4);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    unrolled([&](auto i) __attribute__((always_inline)) {
      constexpr int I = decltype(i)::value;
      const int sc = scales[2 * g + (I * W) / 16];
      const vi q = (((load_u8(lo + I * W) >> lo_shift) & 15)
                    | (((load_u8(hi + I * W) >> hi_shift) & 3) << 4)) - 32;
      out[I] = q * sc;
    }, std::make_index_sequence<kVecsPerGroup>{});
  }
};

template <typename Q, typename F>
[[gnu::always_inline]] inline void decode(const uint8_t* b, F&& f) {
  const typename Q::Head h = Q::head(b);
  unrolled([&](auto g) __attribute__((always_inline)) {
    vf out[kVecsPerGroup];
    Q::group(b, h, decltype(g)::value, out);
    unrolled([&](auto i) __attribute__((always_inline)) { f(kGroup * decltype(g)::value, i, out[decltype(i)::value]); },
             std::make_index_sequence<kVecsPerGroup>{});
  }, std::make_index_sequence<Q::kGroups>{});
}

// ---- x packed per tile of rows, so a tile's loads are contiguous: rows at a stride of K floats
// (a multiple of 4 KiB for the usual K) would all fall into one L1 set and evict each other.

// gemv layout of mt rows of x: vector kv of row m at xp[(kv stride + m) W] (stride >= mt).
void pack_gemv(const float* x, int64_t mt, int64_t K, int64_t stride, float* xp) {
  const int64_t num_vecs = K / W;
  for (int64_t kv = 0; kv < num_vecs; ++kv)
    for (int64_t m = 0; m < mt; ++m)
      std::memcpy(xp + (kv * stride + m) * W, x + m * K + kv * W, W * sizeof(float));
}

// tiled layout of rows [m0, m0 + mt): x[m0 + m, k] at xp[m0 K + k mt + m].
void pack_tiled(const float* x, int64_t m0, int64_t mt, int64_t K, float* xp) {
  for (int64_t m = 0; m < mt; ++m)
    for (int64_t k = 0; k < K; ++k) xp[m0 * K + k * mt + m] = x[(m0 + m) * K + k];
}

// ---- gemv: rows [n0, n1) of W times MT rows of x (x packed by pack_gemv; y at stride N).

// K runs in chunks of x that stay in L1 (kGemvFloats floats of the tile) while each of the at
// most kGemvRows rows of W takes its part; the rows' partial sums (vectors) wait in part[].
template <typename Q, int MT>
void gemv_rows(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
               int64_t n1, float* y, int64_t N) {
  // Independent accumulator chains per x row when there are few rows (FMA latency).
  constexpr int NA = std::min(kVecsPerGroup, std::max(1, 4 / MT));
  constexpr int64_t KC = std::max<int64_t>(Q::kElems, kGemvFloats / MT / Q::kElems * Q::kElems);
  vf part[kGemvRows][MT][NA];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kb0 = k0 / Q::kElems, kb1 = std::min(K, k0 + KC) / Q::kElems;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      vf acc[MT][NA];
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
        for (int a = 0; a < NA; ++a) acc[m][a] = k0 == 0 ? vf{} : part[n - n0][m][a];
      for (int64_t kb = kb0; kb < kb1; ++kb) {
        const float* xb = x + kb * Q::kElems * MT;
        decode<Q>(row + kb * Q::kBytes, [&](int offset, auto i, vf wv) {
          constexpr int I = decltype(i)::value;
          const float* xk = xb + (offset + I * W) * MT;
#pragma GCC unroll 16
          for (int m = 0; m < MT; ++m) acc[m][I % NA] += load(xk + m * W) * wv;
        });
      }
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
        for (int a = 0; a < NA; ++a) part[n - n0][m][a] = acc[m][a];
    }
  }
  for (int64_t n = n0; n < n1; ++n) {
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      vf s = part[n - n0][m][0];
#pragma GCC unroll 4
      for (int a = 1; a < NA; ++a) s += part[n - n0][m][a];
      y[m * N + n] = reduce_add(s);
    }
  }
}

// Register-blocked gemv for several rows of x (mt >= kBlockMin, packed by pack_gemv at a
// stride of kGemvTile rows): per K chunk of kBlockK, kBlockCols rows of W are decoded once into
// an L1 buffer (plain vector stores), then every tile of R rows of x runs over it with R x C
// accumulators (R + C loads per R C FMAs). Partial sums wait in part[] across the chunks, as
// in gemv_rows.
constexpr int kBlockRows = kNumRegs >= 32 ? 4 : 2;  // R: rows of x per register block
constexpr int kBlockCols = 4;                       // C: rows of W per register block
constexpr int kBlockK = 256;                        // K elements per decoded chunk

template <int R, int C>
inline void gemv_block(const float* x, const float* wd, int num_vecs, vf (*part)[kGemvTile],
                       bool first) {
  vf acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = first ? vf{} : part[c][r];
  for (int v = 0; v < num_vecs; ++v) {
    vf wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      vf t = load(wd + c * kBlockK + v * W);
      asm("" : "+v"(t));  // one load per vector (GCC would fold it into every FMA)
      wv[c] = t;
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      vf xv = load(x + (v * kGemvTile + r) * W);
      asm("" : "+v"(xv));
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) part[c][r] = acc[r][c];
}

template <int R, int C>
inline void gemv_block_rows(int rr, const float* x, const float* wd, int num_vecs,
                            vf (*part)[kGemvTile], bool first) {
  if constexpr (R >= 1) {
    if (rr == R) {
      gemv_block<R, C>(x, wd, num_vecs, part, first);
    } else {
      gemv_block_rows<R - 1, C>(rr, x, wd, num_vecs, part, first);
    }
  }
}

template <typename Q>
void gemv_blocked(const float* x, int mt, int64_t K, const uint8_t* w, int64_t row_bytes,
                  int64_t n0, int64_t n1, float* y, int64_t N) {
  constexpr int C = kBlockCols;
  constexpr int64_t KC = std::max(kBlockK, Q::kElems);
  static_assert(KC == kBlockK, "a chunk holds whole blocks");
  alignas(64) float wd[C * kBlockK];
  vf part[kGemvRows][kGemvTile];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kb0 = k0 / Q::kElems, kb1 = std::min(K, k0 + KC) / Q::kElems;
    const int num_vecs = static_cast<int>((kb1 - kb0) * Q::kElems / W);
    for (int64_t n = n0; n < n1; n += C) {
      const int nc = static_cast<int>(std::min<int64_t>(C, n1 - n));
      for (int c = 0; c < nc; ++c) {
        const uint8_t* row = w + (n + c) * row_bytes;
        for (int64_t kb = kb0; kb < kb1; ++kb) {
          float* out = wd + c * kBlockK + (kb - kb0) * Q::kElems;
          decode<Q>(row + kb * Q::kBytes, [&](int offset, auto i, vf wv) {
            store(out + offset + decltype(i)::value * W, wv);
          });
        }
      }
      for (int r0 = 0; r0 < mt; r0 += kBlockRows) {
        const int rr = std::min(kBlockRows, mt - r0);
        const float* xr = x + k0 * kGemvTile + r0 * W;
        vf(*pp)[kGemvTile] = reinterpret_cast<vf(*)[kGemvTile]>(&part[n - n0][r0]);
        if (nc == C) {
          gemv_block_rows<kBlockRows, C>(rr, xr, wd, num_vecs, pp, k0 == 0);
        } else {
          for (int c = 0; c < nc; ++c)
            gemv_block_rows<kBlockRows, 1>(rr, xr, wd + c * kBlockK, num_vecs, pp + c, k0 == 0);
        }
      }
    }
  }
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < mt; ++m) y[m * N + n] = reduce_add(part[n - n0][m]);
}

// Rows of x in passes of at most kGemvTile, balanced (M = 20: 10 + 10, not 16 + 4):
// pass p holds rows [pass_start(p), pass_start(p + 1)).
inline int64_t pass_start(int64_t p, int64_t M, int64_t passes) { return p * M / passes; }

template <typename Q>
void gemv(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
          float* xp, float* y, int32_t num_threads) {
  // Pass p's rows packed at xp + p kGemvTile K: at a stride of kGemvTile rows (compile-time
  // offsets) for the register-blocked kernel, of its own row count for gemv_rows.
  const int64_t passes = (M + kGemvTile - 1) / kGemvTile;
  for (int64_t p = 0; p < passes && xp != nullptr; ++p) {
    const int64_t m0 = pass_start(p, M, passes), mt = pass_start(p + 1, M, passes) - m0;
    pack_gemv(x + m0 * K, mt, K, mt >= kBlockMin ? kGemvTile : mt, xp + p * kGemvTile * K);
  }
  const float* xs = xp != nullptr ? xp : x;  // one row is its own packing
  const bool parallel = num_threads > 1 && N > 1 && N * K * M >= kParallelWork;
  const int64_t num_chunks = (N + kGemvRows - 1) / kGemvRows;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t n0 = c * kGemvRows, n1 = std::min(N, n0 + kGemvRows);
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t m0 = pass_start(p, M, passes);
      const int mt = static_cast<int>(pass_start(p + 1, M, passes) - m0);
      const float* xt = xs + p * kGemvTile * K;
      if (mt >= kBlockMin) {
        gemv_blocked<Q>(xt, mt, K, w, row_bytes, n0, n1, y + m0 * N, N);
      } else {
        gemv_rows<Q, 1>(xt, K, w, row_bytes, n0, n1, y + m0 * N, N);
      }
    }
  }
}

// ---- tiled: decode an [NT columns x kc] tile of W once, transposed, and run all of x over it.

// One step of a W x W transpose of vectors (vf or vi): swaps bit S of the row and column index.
template <int S, typename V, size_t... J>
[[gnu::always_inline]] inline void transpose_step(V& a, V& b, std::index_sequence<J...>) {
  const V lo = __builtin_shufflevector(a, b, ((J & S) == 0 ? J : W + J - S)...);
  const V hi = __builtin_shufflevector(a, b, ((J & S) == 0 ? J + S : W + J)...);
  a = lo;
  b = hi;
}

// r[0..W) transposed in place (log2 W stages of W two-source shuffles).
template <int S, typename V>
[[gnu::always_inline]] inline void transpose_stage(V* r) {
  if constexpr (S >= 1) {
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i)
      if ((i & S) == 0) transpose_step<S>(r[i], r[i + S], std::make_index_sequence<W>{});
    transpose_stage<S / 2>(r);
  }
}

// wt[k * NT + r] = W[n0 + r, k0 + k] for k < kc, r < num_cols (columns past num_cols are zero).
// Per block and W columns: each row's block decoded with vector stores into a row-major buffer,
// then W x W transposes in registers store whole vectors of wt.
template <typename Q>
void pack_tile(const uint8_t* w, int64_t row_bytes, int64_t n0, int num_cols, int64_t k0,
               int64_t kc, float* wt) {
  alignas(64) float rows[W][Q::kElems];
  for (int64_t kb = 0; kb < kc / Q::kElems; ++kb) {
    for (int h = 0; h < kTileCols; h += W) {
      for (int r = 0; r < W; ++r) {
        if (h + r >= num_cols) {
          std::memset(rows[r], 0, sizeof rows[r]);
          continue;
        }
        const uint8_t* blk = w + (n0 + h + r) * row_bytes + (k0 / Q::kElems + kb) * Q::kBytes;
        decode<Q>(blk, [&](int offset, auto i, vf wv) {
          store(rows[r] + offset + decltype(i)::value * W, wv);
        });
      }
      for (int k = 0; k < Q::kElems; k += W) {
        vf t[W];
#pragma GCC unroll 16
        for (int r = 0; r < W; ++r) t[r] = load(rows[r] + k);
        transpose_stage<W / 2>(t);
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) store(wt + (kb * Q::kElems + k + j) * kTileCols + h, t[j]);
      }
    }
  }
}

// y[m, 0..num_cols) (+)= sum_k x[m, k] wt[k, :] for MT rows (x packed by pack_tiled, at its
// chunk's first k; y at stride N).
template <int MT>
void micro_kernel(const float* x, const float* wt, int64_t kc, float* y, int64_t N,
                  int num_cols, bool first) {
  constexpr int NV = kTileCols / W;
  vf acc[MT][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[m][v] = vf{};
    if (!first) {
      float tmp[kTileCols] = {};
      std::memcpy(tmp, y + m * N, num_cols * sizeof(float));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] = load(tmp + v * W);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    vf wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = load(wt + k * kTileCols + v * W);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const vf xb = splat(x[k * MT + m]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] += xb * wv[v];
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    float tmp[kTileCols];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(tmp + v * W, acc[m][v]);
    std::memcpy(y + m * N, tmp, num_cols * sizeof(float));
  }
}

template <int MT>
void micro_dispatch(int mt, const float* x, const float* wt, int64_t kc, float* y,
                    int64_t N, int num_cols, bool first) {
  if constexpr (MT >= 1) {
    if (mt == MT) {
      micro_kernel<MT>(x, wt, kc, y, N, num_cols, first);
    } else {
      micro_dispatch<MT - 1>(mt, x, wt, kc, y, N, num_cols, first);
    }
  }
}

template <typename Q>
void tiled(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
           float* xp, float* y, int32_t num_threads) {
  static_assert(kChunkK % Q::kElems == 0, "a K chunk holds whole blocks");
  for (int64_t m0 = 0; m0 < M && xp != nullptr; m0 += kTileRows)
    pack_tiled(x, m0, std::min<int64_t>(kTileRows, M - m0), K, xp);
  const float* xs = xp != nullptr ? xp : x;
  const int64_t num_tiles = (N + kTileCols - 1) / kTileCols;
  const bool parallel = num_threads > 1 && num_tiles > 1 && N * K * M >= kParallelWork;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t t = 0; t < num_tiles; ++t) {
    alignas(64) float wt[kChunkK * kTileCols];
    const int64_t n0 = t * kTileCols;
    const int num_cols = static_cast<int>(std::min<int64_t>(kTileCols, N - n0));
    for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
      const int64_t kc = std::min<int64_t>(kChunkK, K - k0);
      pack_tile<Q>(w, row_bytes, n0, num_cols, k0, kc, wt);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int mt = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        micro_dispatch<kTileRows>(mt, xs + m0 * K + k0 * mt, wt, kc, y + m0 * N + n0, N,
                                  num_cols, k0 == 0);
      }
    }
  }
}

// ---- int8 activations (opt-in; asyncpaged_quant_matmul_int8): x is quantized per block of
// the weight type's size QB (32 for Q8_0 / Q4_0, 256 for the K-quants, as llama.cpp's Q8_0 and
// Q8_K): dx = max|x| / 127 (float32), q = round-to-nearest-even(x * (1 / dx)) in [-127, 127].
// Every weight block becomes int16 codes with its sub-block scales folded in, so one block's
// dot product is a single exact int32 sum:
//
//   Q8_0: c = qs (int8)                 y += (d dx) sum c q
//   Q4_0: c = nibble - 8                y += (d dx) sum c q
//   Q4_K, Q5_K: c = sc[j] n             y += (d dx) sum c q - (dmin dx) sum_j m[j] bsum[j]
//   Q6_K: c = sc[g] (n - 32)            y += (d dx) sum c q
//
// (bsum[j]: the sum of x's 32 codes of sub-block j). |c| <= 4096 and |q| <= 127, so every sum is
// exact in int32; only the float combination rounds (float32 products and sums).
//
// Lanes run over rows of W: a group of W rows (one int32 lane each) has its codes for a K chunk
// of 256 decoded once into an L1 buffer interleaved as [k / 2][row] int16 pairs, and every
// tile of R rows of x runs over it: per pair of k, one vector load of codes, R broadcasts of
// x's pair and R pairwise multiply-adds (vpdpwssd with AVX512-VNNI, else pmaddwd + add), so the
// per-block float work (one convert and one FMA per row) serves W rows of W at once and y is
// stored as whole vectors, with no horizontal sums.

constexpr int kI8ChunkK = 256;                   // K elements per decoded chunk of a row group
constexpr int kI8Rows = kNumRegs >= 32 ? 8 : 4;  // rows of x per register tile

template <typename Q>
constexpr bool kHasMins = std::is_same_v<Q, Q4_K> || std::is_same_v<Q, Q5_K>;

// Block b's float factors (a: d; bm: dmin) and, for Q4_K / Q5_K, its eight 6-bit mins.
template <typename Q>
inline void block_factors(const uint8_t* b, float& a, float& bm, int16_t* mins) {
  if constexpr (std::is_same_v<Q, Q6_K>) {
    a = fp16_to_float(b + 208);
  } else {
    a = fp16_to_float(b);
  }
  if constexpr (kHasMins<Q>) {
    bm = fp16_to_float(b + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(b + 4, j, sc, m);
      mins[j] = static_cast<int16_t>(m);
    }
  }
}

// W int32 lanes narrowed to int16 (every code fits) at p.
[[gnu::always_inline]] inline void store_i16(int16_t* p, vi v) {
#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512F__)
  __m512i r;
  std::memcpy(&r, &v, sizeof v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#elif ASYNCPAGED_VEC_BYTES == 32 && defined(__AVX2__)
  __m256i r;
  std::memcpy(&r, &v, sizeof v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
#elif ASYNCPAGED_VEC_BYTES == 16 && defined(__SSE2__)
  __m128i r;
  std::memcpy(&r, &v, sizeof v);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(r, r));
#else
  for (int l = 0; l < W; ++l) p[l] = static_cast<int16_t>(v[l]);
#endif
}

inline int32_t pair16(int16_t lo, int16_t hi) {
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo))
                              | (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
}

// acc + per lane (a.lo * b.lo + a.hi * b.hi), the int16 halves of each int32 lane; b one pair
// broadcast. Exact in int32 for the codes here.
template <bool kVnni>
[[gnu::always_inline]] inline vi dot_pairs(vi acc, vi a, int32_t b) {
  const vi bv = b - vi{};
#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512BW__)
  if constexpr (kVnni) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(bv));  // AVX512-VNNI
    return acc;
  }
  __m512i ai, bi;
  std::memcpy(&ai, &a, sizeof a);
  std::memcpy(&bi, &bv, sizeof bv);
  const __m512i p = _mm512_madd_epi16(ai, bi);
  vi pv;
  std::memcpy(&pv, &p, sizeof pv);
  return acc + pv;
#elif ASYNCPAGED_VEC_BYTES == 32 && defined(__AVX2__)
  __m256i ai, bi;
  std::memcpy(&ai, &a, sizeof a);
  std::memcpy(&bi, &bv, sizeof bv);
  const __m256i p = _mm256_madd_epi16(ai, bi);
  vi pv;
  std::memcpy(&pv, &p, sizeof pv);
  return acc + pv;
#elif ASYNCPAGED_VEC_BYTES == 16 && defined(__SSE2__)
  __m128i ai, bi;
  std::memcpy(&ai, &a, sizeof a);
  std::memcpy(&bi, &bv, sizeof bv);
  const __m128i p = _mm_madd_epi16(ai, bi);
  vi pv;
  std::memcpy(&pv, &p, sizeof pv);
  return acc + pv;
#else
  return acc + ((a << 16) >> 16) * ((bv << 16) >> 16) + (a >> 16) * (bv >> 16);
#endif
}

// x quantized: per row, K int16 codes, K / QB scales dx and K / 32 sums of 32 codes (bsum).
// With q8 (not null): the codes again as int8 and qsum16, K / 16 sums of 16 codes.
template <typename Q>
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* q, float* dx, int16_t* bsum,
                   int8_t* q8 = nullptr, int16_t* qsum16 = nullptr) {
  constexpr int QB = Q::kElems;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / QB; ++b) {
      const float* xb = x + m * K + b * QB;
      float amax = 0.0f;
      for (int i = 0; i < QB; ++i) {
        const float a = std::fabs(xb[i]);
        amax = a > amax ? a : amax;
      }
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      dx[m * (K / QB) + b] = d;
      int16_t* qb = q + m * K + b * QB;
      for (int i = 0; i < QB; ++i) {
        float r = __builtin_rintf(xb[i] * id);  // round to nearest even (the default mode)
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        qb[i] = static_cast<int16_t>(r == r ? r : 0.0f);
      }
      for (int j = 0; j < QB / 32; ++j) {
        int s = 0;
        for (int i = 0; i < 32; ++i) s += qb[32 * j + i];
        bsum[m * (K / 32) + b * (QB / 32) + j] = static_cast<int16_t>(s);
      }
      if (q8 != nullptr) {
        for (int i = 0; i < QB; ++i) q8[m * K + b * QB + i] = static_cast<int8_t>(qb[i]);
        for (int j = 0; j < QB / 16; ++j) {
          int s = 0;
          for (int i = 0; i < 16; ++i) s += qb[16 * j + i];
          qsum16[m * (K / 16) + b * (QB / 16) + j] = static_cast<int16_t>(s);
        }
      }
    }
}

// The decoded chunk of one group of W rows: codes [k / 2][lane] int16 pairs, a and bm [block]
// [lane] floats, mins [block][4][lane] int16 pairs (Q4_K / Q5_K).
struct alignas(64) I8Chunk {
  int32_t codes[kI8ChunkK / 2 * W];
  float a[kI8ChunkK / 32 * W];
  float bm[W];
  int32_t mins[4 * W];
};

// Rows [n0, n0 + num_rows) of W (lanes past num_rows get zeros), blocks [kb, kb + num_blocks):
// each row's codes decoded with vector ops into a row-major int16 buffer, then transposed W x W
// int32 pairs at a time into ch.codes.
template <typename Q>
void decode_chunk(const uint8_t* w, int64_t row_bytes, int64_t n0, int num_rows, int64_t kb,
                  int num_blocks, I8Chunk& ch) {
  static_assert(kI8ChunkK % Q::kElems == 0, "a chunk holds whole blocks");
  alignas(64) int16_t rows[W][kI8ChunkK];
  int16_t mins[8] = {};
  const int num_elems = num_blocks * Q::kElems;
  for (int l = 0; l < W; ++l) {
    if (l >= num_rows) {  // past N: zero codes and factors
      std::memset(rows[l], 0, num_elems * sizeof(int16_t));
      for (int b = 0; b < num_blocks; ++b) ch.a[b * W + l] = 0.0f;
      ch.bm[l] = 0.0f;
      for (int p = 0; p < 4; ++p) ch.mins[p * W + l] = 0;
      continue;
    }
    const uint8_t* row = w + (n0 + l) * row_bytes + kb * Q::kBytes;
    for (int b = 0; b < num_blocks; ++b) {
      const uint8_t* blk = row + b * Q::kBytes;
      float a = 0.0f, bm = 0.0f;
      block_factors<Q>(blk, a, bm, mins);
      ch.a[b * W + l] = a;
      if constexpr (kHasMins<Q>) {
        ch.bm[l] = bm;
        for (int p = 0; p < 4; ++p) ch.mins[p * W + l] = pair16(mins[2 * p], mins[2 * p + 1]);
      }
      unrolled([&](auto g) __attribute__((always_inline)) {
        constexpr int G = decltype(g)::value;
        vi c[kVecsPerGroup];
        Q::igroup(blk, G, c);
#pragma GCC unroll 4
        for (int i = 0; i < kVecsPerGroup; ++i)
          store_i16(rows[l] + b * Q::kElems + kGroup * G + i * W, c[i]);
      }, std::make_index_sequence<Q::kGroups>{});
    }
  }
  for (int k = 0; k < num_elems / 2; k += W) {  // W pairs of each row: one W x W transpose
    vi t[W];
#pragma GCC unroll 16
    for (int l = 0; l < W; ++l) std::memcpy(&t[l], rows[l] + 2 * k, sizeof(vi));
    transpose_stage<W / 2>(t);
#pragma GCC unroll 16
    for (int l = 0; l < W; ++l) std::memcpy(ch.codes + (k + l) * W, &t[l], sizeof(vi));
  }
}

// y[r] (+)= the lanes of R rows of x over one decoded chunk of num_blocks blocks; xq, dx, bsum
// at the chunk's start of row 0, rows at strides K, K / QB and K / 32.
template <typename Q, int R, bool kVnni>
inline void int8_tile(const I8Chunk& ch, int num_blocks, const int16_t* xq, const float* dx,
                      const int16_t* bsum, int64_t K, float* y, int64_t y_stride, bool first) {
  constexpr int QB = Q::kElems;
  vf acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = first ? vf{} : load(y + r * y_stride);
  for (int b = 0; b < num_blocks; ++b) {
    vi isum[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) isum[r] = vi{};
    const int32_t* cb = ch.codes + b * (QB / 2) * W;
    const int16_t* xb = xq + b * QB;
    for (int k = 0; k < QB / 2; ++k) {
      vi cv;
      std::memcpy(&cv, cb + k * W, sizeof cv);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t xp;
        std::memcpy(&xp, xb + r * K + 2 * k, sizeof xp);
        isum[r] = dot_pairs<kVnni>(isum[r], cv, xp);
      }
    }
    const vf a = load(ch.a + b * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float d = dx[r * (K / QB) + b];
      acc[r] += __builtin_convertvector(isum[r], vf) * (a * d);
    }
  }
  if constexpr (kHasMins<Q>) {
    vi mv[4];
    for (int p = 0; p < 4; ++p) std::memcpy(&mv[p], ch.mins + p * W, sizeof(vi));
    const vf bm = load(ch.bm);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      vi msum = vi{};
      for (int p = 0; p < 4; ++p) {
        int32_t bp;
        std::memcpy(&bp, bsum + r * (K / 32) + 2 * p, sizeof bp);
        msum = dot_pairs<kVnni>(msum, mv[p], bp);
      }
      acc[r] -= __builtin_convertvector(msum, vf) * (bm * dx[r * (K / QB)]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store(y + r * y_stride, acc[r]);
}

template <typename Q, int R, bool kVnni>
inline void int8_tile_rows(int rr, const I8Chunk& ch, int num_blocks, const int16_t* xq, const float* dx,
                           const int16_t* bsum, int64_t K, float* y, int64_t y_stride,
                           bool first) {
  if constexpr (R >= 1) {
    if (rr == R) {
      int8_tile<Q, R, kVnni>(ch, num_blocks, xq, dx, bsum, K, y, y_stride, first);
    } else {
      int8_tile_rows<Q, R - 1, kVnni>(rr, ch, num_blocks, xq, dx, bsum, K, y, y_stride, first);
    }
  }
}

// y's columns of row group g (W rows of W) by the int8 product; acc: M x W floats of scratch.
template <typename Q, bool kVnni>
void int8_groups(const int16_t* xq, const float* dx, const int16_t* bsum, int64_t M, int64_t K,
                 const uint8_t* w, int64_t N, int64_t row_bytes, float* y, float* acc,
                 int64_t g) {
  constexpr int QB = Q::kElems;
  I8Chunk ch;
  const int64_t n0 = g * W;
  const int num_rows = static_cast<int>(std::min<int64_t>(W, N - n0));
  for (int64_t k0 = 0; k0 < K; k0 += kI8ChunkK) {
    const int num_blocks = static_cast<int>(std::min<int64_t>(kI8ChunkK, K - k0) / QB);
    decode_chunk<Q>(w, row_bytes, n0, num_rows, k0 / QB, num_blocks, ch);
    for (int64_t m0 = 0; m0 < M; m0 += kI8Rows) {
      const int rr = static_cast<int>(std::min<int64_t>(kI8Rows, M - m0));
      int8_tile_rows<Q, kI8Rows, kVnni>(rr, ch, num_blocks, xq + m0 * K + k0, dx + m0 * (K / QB) + k0 / QB,
                                        bsum + m0 * (K / 32) + k0 / 32, K, acc + m0 * W, W,
                                        k0 == 0);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(y + m * N + n0, acc + m * W, num_rows * sizeof(float));
}

#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512F__)
// The VNNI path (avx512 build, CPU with AVX512-VNNI): unsigned byte codes n (Q8_0: qs + 128,
// Q4_0: the nibble, K-quants: the 4-6 bit value) interleaved as [k / 4][row] quads, multiplied
// by x's int8 codes four at a time (vpdpbusd: 64 products per instruction) per sub-block of S
// elements (32; Q6_K 16), scaled by the sub-block's integer scale (K-quants) and offset per
// block: Q8_0 -128 bsum, Q4_0 -8 bsum, Q6_K -32 sum_g sc[g] qsum16[g]; Q4_K / Q5_K keep the
// separate min term of the pair path. All int32-exact, as the pair path.
template <typename Q>
constexpr int kSubBlock = std::is_same_v<Q, Q6_K> ? 16 : 32;
template <typename Q>
constexpr bool kScaled = Q::kElems == 256;

struct alignas(64) VnniChunk {
  int32_t quads[kI8ChunkK / 4 * W];
  int32_t sc[kI8ChunkK / 16 * W];  // [sub-block][lane] (K-quants)
  int32_t offs[8 * W];             // Q6_K: [pair p][lane] (32 sc[2p], 32 sc[2p + 1])
  float a[kI8ChunkK / 32 * W];
  float bm[W];
  int32_t mins[4 * W];
};

[[gnu::always_inline]] inline void store_u8(uint8_t* p, vi v) {
  __m512i r;
  std::memcpy(&r, &v, sizeof v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(r));
}

[[gnu::always_inline]] inline vi dpbusd(vi acc, vi a, const int8_t* b) {
  int32_t quad;
  std::memcpy(&quad, b, sizeof quad);
  const vi bv = quad - vi{};
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(bv));  // AVX512-VNNI
  return acc;
}

// The VNNI path's unsigned byte codes of one block (kElems bytes at out), with byte-wide
// vector operations on 32 bytes at a time (no widening): Q8_0 qs + 128, Q4_0 and the K-quants
// their 4-6 bit values.
typedef uint8_t vb32 __attribute__((vector_size(32)));

[[gnu::always_inline]] inline vb32 load_b32(const uint8_t* p) {
  vb32 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

[[gnu::always_inline]] inline void store_b32(uint8_t* p, vb32 v) { std::memcpy(p, &v, sizeof v); }

template <typename Q>
[[gnu::always_inline]] inline void block_bytes(const uint8_t* b, uint8_t* out) {
  if constexpr (std::is_same_v<Q, Q8_0>) {
    store_b32(out, load_b32(b + 2) ^ 0x80);
  } else if constexpr (std::is_same_v<Q, Q4_0>) {
    typedef uint8_t vb16 __attribute__((vector_size(16)));  // 16 bytes: the block's end
    vb16 v;
    std::memcpy(&v, b + 2, sizeof v);
    const vb16 lo = v & 15, hi = v >> 4;
    std::memcpy(out, &lo, sizeof lo);
    std::memcpy(out + 16, &hi, sizeof hi);
  } else if constexpr (kHasMins<Q>) {
    const uint8_t* qs = b + (std::is_same_v<Q, Q5_K> ? 48 : 16);
    [[maybe_unused]] const vb32 qh = load_b32(b + 16);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const vb32 v = load_b32(qs + 32 * p);
      vb32 lo = v & 15, hi = v >> 4;
      if constexpr (std::is_same_v<Q, Q5_K>) {
        lo |= ((qh >> (2 * p)) & 1) << 4;
        hi |= ((qh >> (2 * p + 1)) & 1) << 4;
      }
      store_b32(out + 64 * p, lo);
      store_b32(out + 64 * p + 32, hi);
    }
  } else {
    static_assert(std::is_same_v<Q, Q6_K>);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const vb32 qh = load_b32(b + 128 + 32 * h);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const vb32 lo = (load_b32(b + 64 * h + 32 * (c % 2)) >> (4 * (c / 2))) & 15;
        store_b32(out + 128 * h + 32 * c, lo | (((qh >> (2 * c)) & 3) << 4));
      }
    }
  }
}

template <typename Q>
void decode_chunk_vnni(const uint8_t* w, int64_t row_bytes, int64_t n0, int num_rows, int64_t kb,
                       int num_blocks, VnniChunk& ch) {
  alignas(64) uint8_t rows[W][kI8ChunkK];
  int16_t mins[8] = {};
  const int num_elems = num_blocks * Q::kElems;
  for (int l = 0; l < W; ++l) {
    if (l >= num_rows) {
      std::memset(rows[l], 0, num_elems);
      for (int b = 0; b < num_blocks; ++b) ch.a[b * W + l] = 0.0f;
      ch.bm[l] = 0.0f;
      for (int j = 0; j < kI8ChunkK / 16; ++j) ch.sc[j * W + l] = 0;
      for (int p = 0; p < 8; ++p) ch.offs[p * W + l] = 0;
      for (int p = 0; p < 4; ++p) ch.mins[p * W + l] = 0;
      continue;
    }
    const uint8_t* row = w + (n0 + l) * row_bytes + kb * Q::kBytes;
    for (int b = 0; b < num_blocks; ++b) {
      const uint8_t* blk = row + b * Q::kBytes;
      float a = 0.0f, bm = 0.0f;
      block_factors<Q>(blk, a, bm, mins);
      ch.a[b * W + l] = a;
      if constexpr (kHasMins<Q>) {
        ch.bm[l] = bm;
        for (int p = 0; p < 4; ++p) ch.mins[p * W + l] = pair16(mins[2 * p], mins[2 * p + 1]);
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          scale_min_k4(blk + 4, j, sc, m);
          ch.sc[j * W + l] = sc;
        }
      } else if constexpr (std::is_same_v<Q, Q6_K>) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        for (int g = 0; g < 16; ++g) ch.sc[g * W + l] = sc[g];
        for (int p = 0; p < 8; ++p)
          ch.offs[p * W + l] = pair16(static_cast<int16_t>(32 * sc[2 * p]),
                                      static_cast<int16_t>(32 * sc[2 * p + 1]));
      }
      block_bytes<Q>(blk, rows[l] + b * Q::kElems);
    }
  }
  for (int k = 0; k < num_elems / 4; k += W) {  // W quads of each row: one W x W transpose
    vi t[W];
#pragma GCC unroll 16
    for (int l = 0; l < W; ++l) std::memcpy(&t[l], rows[l] + 4 * k, sizeof(vi));
    transpose_stage<W / 2>(t);
#pragma GCC unroll 16
    for (int l = 0; l < W; ++l) std::memcpy(ch.quads + (k + l) * W, &t[l], sizeof(vi));
  }
}

// As int8_tile, with x's int8 codes (q8), bsum (sums of 32) and qsum16 (sums of 16).
template <typename Q, int R>
inline void vnni_tile(const VnniChunk& ch, int num_blocks, const int8_t* q8, const float* dx,
                      const int16_t* bsum, const int16_t* qsum16, int64_t K, float* y,
                      int64_t y_stride, bool first) {
  constexpr int QB = Q::kElems, S = kSubBlock<Q>;
  vf acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = first ? vf{} : load(y + r * y_stride);
  for (int b = 0; b < num_blocks; ++b) {
    vi isum[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if constexpr (std::is_same_v<Q, Q8_0> || std::is_same_v<Q, Q4_0>) {
        constexpr int kOffset = std::is_same_v<Q, Q8_0> ? 128 : 8;
        isum[r] = (-kOffset * bsum[r * (K / 32) + b]) - vi{};
      } else {
        isum[r] = vi{};
      }
    }
    for (int j = 0; j < QB / S; ++j) {
      const int32_t* cb = ch.quads + (b * QB + j * S) / 4 * W;
      const int8_t* xb = q8 + b * QB + j * S;
      vi sub[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) sub[r] = vi{};
#pragma GCC unroll 8
      for (int k = 0; k < S / 4; ++k) {
        vi cv;
        std::memcpy(&cv, cb + k * W, sizeof cv);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) sub[r] = dpbusd(sub[r], cv, xb + r * K + 4 * k);
      }
      if constexpr (kScaled<Q>) {
        vi sc;
        std::memcpy(&sc, ch.sc + (b * (QB / S) + j) * W, sizeof sc);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[r] += sub[r] * sc;
      } else {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[r] += sub[r];
      }
    }
    if constexpr (std::is_same_v<Q, Q6_K>) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        vi off = vi{};
        for (int p = 0; p < 8; ++p) {
          vi ov;
          std::memcpy(&ov, ch.offs + p * W, sizeof ov);
          int32_t qp;
          std::memcpy(&qp, qsum16 + r * (K / 16) + 2 * p, sizeof qp);
          off = dot_pairs<true>(off, ov, qp);
        }
        isum[r] -= off;
      }
    }
    const vf a = load(ch.a + b * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      acc[r] += __builtin_convertvector(isum[r], vf) * (a * dx[r * (K / QB) + b]);
  }
  if constexpr (kHasMins<Q>) {
    vi mv[4];
    for (int p = 0; p < 4; ++p) std::memcpy(&mv[p], ch.mins + p * W, sizeof(vi));
    const vf bm = load(ch.bm);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      vi msum = vi{};
      for (int p = 0; p < 4; ++p) {
        int32_t bp;
        std::memcpy(&bp, bsum + r * (K / 32) + 2 * p, sizeof bp);
        msum = dot_pairs<true>(msum, mv[p], bp);
      }
      acc[r] -= __builtin_convertvector(msum, vf) * (bm * dx[r * (K / QB)]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store(y + r * y_stride, acc[r]);
}

template <typename Q, int R>
inline void vnni_tile_rows(int rr, const VnniChunk& ch, int num_blocks, const int8_t* q8,
                           const float* dx, const int16_t* bsum, const int16_t* qsum16,
                           int64_t K, float* y, int64_t y_stride, bool first) {
  if constexpr (R >= 1) {
    if (rr == R) {
      vnni_tile<Q, R>(ch, num_blocks, q8, dx, bsum, qsum16, K, y, y_stride, first);
    } else {
      vnni_tile_rows<Q, R - 1>(rr, ch, num_blocks, q8, dx, bsum, qsum16, K, y, y_stride, first);
    }
  }
}

template <typename Q>
void vnni_groups(const int8_t* q8, const float* dx, const int16_t* bsum, const int16_t* qsum16,
                 int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, float* y,
                 float* acc, int64_t g) {
  constexpr int QB = Q::kElems;
  VnniChunk ch;
  const int64_t n0 = g * W;
  const int num_rows = static_cast<int>(std::min<int64_t>(W, N - n0));
  for (int64_t k0 = 0; k0 < K; k0 += kI8ChunkK) {
    const int num_blocks = static_cast<int>(std::min<int64_t>(kI8ChunkK, K - k0) / QB);
    decode_chunk_vnni<Q>(w, row_bytes, n0, num_rows, k0 / QB, num_blocks, ch);
    for (int64_t m0 = 0; m0 < M; m0 += kI8Rows) {
      const int rr = static_cast<int>(std::min<int64_t>(kI8Rows, M - m0));
      vnni_tile_rows<Q, kI8Rows>(rr, ch, num_blocks, q8 + m0 * K + k0,
                                 dx + m0 * (K / QB) + k0 / QB, bsum + m0 * (K / 32) + k0 / 32,
                                 qsum16 + m0 * (K / 16) + k0 / 16, K, acc + m0 * W, W, k0 == 0);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(y + m * N + n0, acc + m * W, num_rows * sizeof(float));
}
#endif

#if ASYNCPAGED_VEC_BYTES >= 32 && defined(__AVX2__)
// ---- int8 activations, few rows of x (decode: M <= kI8FewRows; avx2 and avx512 builds). Each
// row of W is streamed once, and its blocks are decoded in registers straight into integer dot
// products with every row of x: no decoded buffer, no interleaving of rows of W. The weights'
// unsigned byte codes u (Q4_0 and the K-quants: their 4-6 bit values; Q8_0: qs + 128 with
// VNNI, else |qs| against x with qs's sign, llama.cpp's sign trick) times x's int8 codes, 32 at
// a time (256-bit vectors in both builds):
//
//   Q8_0, Q4_0: vpdpbusd (AVX512-VNNI) or pmaddubsw + pmaddwd(1) -> int32 lanes of 4 products;
//               8 blocks' lanes reduced at once to 8 exact block sums (a vphaddd tree), minus
//               128 bsum (Q8_0 with VNNI) or 8 bsum (Q4_0); y += float(S) (d dx) per lane, the
//               8 lanes summed at the row's end.
//   Q4_K, Q5_K: pmaddubsw -> int16 pairs, times the sub-block's scale sc[j] into int32 lanes
//               (vpdpwssd, or pmaddwd + add); per block S = the lanes' sum,
//               y += float(S) (d dx) - float(sum_j m[j] bsum[j]) (dmin dx).
//   Q6_K:       as Q4_K with 16-element scales, minus 32 sum_t sc[t] qsum16[t].
//
// pmaddubsw saturates no pair here (|u| <= 128 with the sign trick, 63 otherwise; |x| <= 127),
// and every block sum is exact in int32, so the result is the int8 path's, up to the order of
// the float32 sum over blocks.

constexpr int kI8FewRows = 8;     // most rows of x for the few-rows kernel

// The rows of x up to which the few-rows kernel is the faster one (Zen 4, N = K = 4096, 1
// thread): with VNNI the chunked kernel catches up at 3-6 rows (Q6_K: past 8); without it, the
// few-rows kernel is as fast or faster up to 8 rows.
template <typename Q>
constexpr int few_rows_limit(bool use_vnni) {
  if (!use_vnni || std::is_same_v<Q, Q6_K>) return kI8FewRows;
  return std::is_same_v<Q, Q8_0> ? 3 : 4;
}
constexpr int64_t kI8FewWork = 16;  // rows of W per work item

// x's codes as the few-rows kernel reads them: rows at strides K (q8), K / QB (dx), K / 32
// (bsum), K / 16 (qsum16, Q6_K).
struct FewRowsX {
  const int8_t* q8;
  const float* dx;
  const int16_t* bsum;
  const int16_t* qsum16;
  int64_t K;
};

[[gnu::always_inline]] inline __m256i loadu_256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

[[gnu::always_inline]] inline __m128i loadu_128(const void* p) {
  return _mm_loadu_si128(static_cast<const __m128i*>(p));
}

// Per int32 lane, the sum of 4 products u (unsigned bytes) x s (signed bytes).
template <bool kVnni>
[[gnu::always_inline]] inline __m256i dot4_u8s8(__m256i u, __m256i s) {
  if constexpr (kVnni) {
    __m256i acc = _mm256_setzero_si256();
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));  // AVX512-VNNI (VL)
    return acc;
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
}

// acc + per int32 lane (a.lo b.lo + a.hi b.hi) of the int16 halves.
template <bool kVnni>
[[gnu::always_inline]] inline __m256i dot2_i16(__m256i acc, __m256i a, __m256i b) {
  if constexpr (kVnni) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));  // AVX512-VNNI (VL)
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
  }
}

#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512BW__)
// Q4_K / Q5_K in the avx512 build: 64 bytes of nibbles at a time, x's codes reordered per block
// (sub-blocks 0 2 1 3 4 6 5 7, see kFewZmm) so that each half of a vector meets its own codes.
constexpr bool kFewZmm = true;

template <bool kVnni>
[[gnu::always_inline]] inline __m512i dot2_i16(__m512i acc, __m512i a, __m512i b) {
  if constexpr (kVnni) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));  // AVX512-VNNI
    return acc;
  } else {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
  }
}

// Bit J (<= 5) of every byte of v moved to bit 4 (the rest zero).
template <int J>
[[gnu::always_inline]] inline __m512i bit_to_4(__m512i v) {
  const __m512i s = J <= 4 ? _mm512_slli_epi16(v, 4 - J) : _mm512_srli_epi16(v, J - 4);
  return _mm512_and_si512(s, _mm512_set1_epi8(0x10));
}

// Words 0-15 from word A of v, 16-31 from word B.
template <int A, int B>
[[gnu::always_inline]] inline __m512i halves_of(__m512i v) {
  const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16(A), _mm256_set1_epi16(B), 1);
  return _mm512_permutexvar_epi16(idx, v);
}
#else
constexpr bool kFewZmm = false;
#endif

[[gnu::always_inline]] inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

[[gnu::always_inline]] inline int32_t hsum_i32(__m128i s) {
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

[[gnu::always_inline]] inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

[[gnu::always_inline]] inline uint16_t load_u16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return h;
}

// The fp16 scales d of 8 consecutive blocks of B bytes (d at each block's start) as float32.
template <int B>
[[gnu::always_inline]] inline __m256 block_d8(const uint8_t* b) {
  const __m128i h = _mm_setr_epi16(
      static_cast<int16_t>(load_u16(b)), static_cast<int16_t>(load_u16(b + B)),
      static_cast<int16_t>(load_u16(b + 2 * B)), static_cast<int16_t>(load_u16(b + 3 * B)),
      static_cast<int16_t>(load_u16(b + 4 * B)), static_cast<int16_t>(load_u16(b + 5 * B)),
      static_cast<int16_t>(load_u16(b + 6 * B)), static_cast<int16_t>(load_u16(b + 7 * B)));
  return _mm256_cvtph_ps(h);
}

// Q8_0 / Q4_0: rows [n0, n1) of W times R rows of x.
template <typename Q, int R, bool kVnni>
void few_rows_q32(const FewRowsX& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                  float* y, int64_t N) {
  constexpr bool kQ8 = std::is_same_v<Q, Q8_0>;
  constexpr int kShift = kQ8 ? (kVnni ? 7 : -1) : 3;  // the code offset's log2 (-1: none)
  const int64_t K = x.K, nb = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    // p[r]: block b's int32 lanes with row r (zero past the row's last block).
    const auto block = [&](int64_t b, __m256i* p) __attribute__((always_inline)) {
      const uint8_t* blk = row + b * Q::kBytes;
      if constexpr (kQ8) {
        const __m256i qs = loadu_256(blk + 2);
        if constexpr (kVnni) {
          const __m256i u = _mm256_xor_si256(qs, _mm256_set1_epi8(static_cast<char>(0x80)));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) p[r] = dot4_u8s8<true>(u, loadu_256(x.q8 + r * K + 32 * b));
        } else {
          const __m256i u = _mm256_abs_epi8(qs);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            p[r] = dot4_u8s8<false>(u, _mm256_sign_epi8(loadu_256(x.q8 + r * K + 32 * b), qs));
        }
      } else {
        const __m128i raw = loadu_128(blk + 2);
        const __m256i both =
            _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
        const __m256i u = _mm256_and_si256(both, _mm256_set1_epi8(15));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) p[r] = dot4_u8s8<kVnni>(u, loadu_256(x.q8 + r * K + 32 * b));
      }
    };
    // 8 blocks from b0 (count of them real): exact block sums, scaled and accumulated.
    const auto group = [&](int64_t b0, int count) __attribute__((always_inline)) {
      __m256i p0[R], p1[R], h01[R], q0123[R], q4567[R];
#pragma GCC unroll 4
      for (int half = 0; half < 2; ++half) {
#pragma GCC unroll 4
        for (int pair = 0; pair < 2; ++pair) {
          const int i = 4 * half + 2 * pair;
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm256_setzero_si256();
          if (i < count) block(b0 + i, p0);
          if (i + 1 < count) block(b0 + i + 1, p1);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256i h = _mm256_hadd_epi32(p0[r], p1[r]);
            if (pair == 0) {
              h01[r] = h;
            } else {
              (half == 0 ? q0123 : q4567)[r] = _mm256_hadd_epi32(h01[r], h);
            }
          }
        }
      }
      __m256 d;
      alignas(32) float dxs[R][8] = {};
      alignas(16) int16_t bs[R][8] = {};
      const bool full = count == 8;
      if (full) {
        d = block_d8<Q::kBytes>(row + b0 * Q::kBytes);
      } else {
        alignas(32) float ds[8] = {};
        for (int i = 0; i < count; ++i) ds[i] = fp16_to_float(row + (b0 + i) * Q::kBytes);
        d = _mm256_load_ps(ds);
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < count; ++i) {
            dxs[r][i] = x.dx[r * nb + b0 + i];
            bs[r][i] = x.bsum[r * nb + b0 + i];
          }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(q0123[r], q4567[r], 0x20),
                                     _mm256_permute2x128_si256(q0123[r], q4567[r], 0x31));
        if constexpr (kShift >= 0) {
          const __m128i b16 = loadu_128(full ? x.bsum + r * nb + b0 : bs[r]);
          s = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_cvtepi16_epi32(b16), kShift));
        }
        const __m256 dxv = _mm256_loadu_ps(full ? x.dx + r * nb + b0 : dxs[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, dxv), acc[r]);
      }
    };
    int64_t b0 = 0;
    for (; b0 + 8 <= nb; b0 += 8) group(b0, 8);
    if (b0 < nb) group(b0, static_cast<int>(nb - b0));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) y[r * N + n] = hsum_ps(acc[r]);
  }
}

// Bit J of every byte of v moved to bit 4 (the rest zero).
template <int J>
[[gnu::always_inline]] inline __m256i bit_to_4(__m256i v) {
  const __m256i s = J <= 4 ? _mm256_slli_epi16(v, 4 - J) : _mm256_srli_epi16(v, J - 4);
  return _mm256_and_si256(s, _mm256_set1_epi8(0x10));
}

// Q4_K / Q5_K / Q6_K: rows [n0, n1) of W times R rows of x.
template <typename Q, int R, bool kVnni>
void few_rows_k(const FewRowsX& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                float* y, int64_t N) {
  const int64_t K = x.K, nb = K / 256;
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float acc[R] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * Q::kBytes;
      const int8_t* xb = x.q8 + 256 * b;
      __m256i isum[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      if constexpr (kHasMins<Q>) {
        // The 6-bit scales and mins as bytes (llama.cpp's unpacking of the 12 bytes).
        uint32_t s[4];
        std::memcpy(s, blk + 4, 12);
        constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
        s[3] = ((s[2] >> 4) & k4) | (((s[1] >> 6) & k2) << 4);
        const uint32_t m03 = s[1] & k6;
        s[1] = (s[2] & k4) | (((s[0] >> 6) & k2) << 4);
        s[2] = m03;
        s[0] &= k6;
        alignas(16) int16_t sc[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(sc),
                        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))));
        const __m128i mins =
            _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 2)));
        constexpr bool kHigh = std::is_same_v<Q, Q5_K>;
        const uint8_t* qs = blk + (kHigh ? 48 : 16);
        [[maybe_unused]] const __m256i qh = loadu_256(blk + 16);
#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512BW__)
        // Vector P: qs[64 P, + 64): low nibbles sub-blocks 4P and 4P + 2, high ones 4P + 1 and
        // 4P + 3, against x's codes in the order of kFewZmm.
        const __m512i sc16 = _mm512_castsi128_si512(
            _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))));
        [[maybe_unused]] const __m512i qhz =
            _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
        const __m512i low4z = _mm512_set1_epi8(15);
        __m512i zsum[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) zsum[r] = _mm512_setzero_si512();
        unrolled([&](auto pc) __attribute__((always_inline)) {
          constexpr int P = decltype(pc)::value;
          const __m512i v = _mm512_loadu_si512(qs + 64 * P);
          __m512i lo = _mm512_and_si512(v, low4z);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4z);
          if constexpr (kHigh) {
            lo = _mm512_or_si512(lo, bit_to_4<4 * P>(qhz));
            hi = _mm512_or_si512(hi, bit_to_4<4 * P + 1>(qhz));
          }
          const __m512i slo = halves_of<4 * P, 4 * P + 2>(sc16);
          const __m512i shi = halves_of<4 * P + 1, 4 * P + 3>(sc16);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = xb + r * K + 128 * P;
            zsum[r] = dot2_i16<kVnni>(zsum[r], _mm512_maddubs_epi16(lo, _mm512_loadu_si512(xr)), slo);
            zsum[r] = dot2_i16<kVnni>(
                zsum[r], _mm512_maddubs_epi16(hi, _mm512_loadu_si512(xr + 64)), shi);
          }
        }, std::make_index_sequence<2>{});
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          isum[r] = _mm256_add_epi32(_mm512_castsi512_si256(zsum[r]),
                                     _mm512_extracti64x4_epi64(zsum[r], 1));
#else
        unrolled([&](auto pc) __attribute__((always_inline)) {
          constexpr int P = decltype(pc)::value;
          const __m256i v = loadu_256(qs + 32 * P);
          __m256i lo = _mm256_and_si256(v, low4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (kHigh) {
            lo = _mm256_or_si256(lo, bit_to_4<2 * P>(qh));
            hi = _mm256_or_si256(hi, bit_to_4<2 * P + 1>(qh));
          }
          const __m256i slo = _mm256_set1_epi16(sc[2 * P]);
          const __m256i shi = _mm256_set1_epi16(sc[2 * P + 1]);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = xb + r * K + 64 * P;
            isum[r] = dot2_i16<kVnni>(isum[r], _mm256_maddubs_epi16(lo, loadu_256(xr)), slo);
            isum[r] =
                dot2_i16<kVnni>(isum[r], _mm256_maddubs_epi16(hi, loadu_256(xr + 32)), shi);
          }
        }, std::make_index_sequence<4>{});
#endif
        const float d = fp16_to_float(blk), dmin = fp16_to_float(blk + 2);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m128i bs = loadu_128(x.bsum + r * (K / 32) + 8 * b);
          const int32_t msum = hsum_i32(_mm_madd_epi16(mins, bs));
          const float dx = x.dx[r * nb + b];
          acc[r] += static_cast<float>(hsum_i32(isum[r])) * (d * dx);
          acc[r] -= static_cast<float>(msum) * (dmin * dx);
        }
      } else {
        static_assert(std::is_same_v<Q, Q6_K>);
        const __m128i sc8 = loadu_128(blk + 192);
        const __m256i sc_all = _mm256_cvtepi8_epi16(sc8);
        // [sc0 sc2 .. sc14 | sc1 sc3 .. sc15] as int16: group g's pair (sc[2g], sc[2g + 1])
        // is element g of each half.
        const __m256i sc_eo = _mm256_cvtepi8_epi16(
            _mm_shuffle_epi8(sc8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
        const __m256i hi2 = _mm256_set1_epi8(0x30);
        unrolled([&](auto hc) __attribute__((always_inline)) {
          constexpr int H = decltype(hc)::value;
          const __m256i ql0 = loadu_256(blk + 64 * H), ql1 = loadu_256(blk + 64 * H + 32);
          const __m256i qh = loadu_256(blk + 128 + 32 * H);
          unrolled([&](auto cc) __attribute__((always_inline)) {
            constexpr int C = decltype(cc)::value, G = 4 * H + C;
            const __m256i l = C % 2 == 0 ? ql0 : ql1;
            const __m256i lo = C / 2 == 0 ? _mm256_and_si256(l, low4)
                                          : _mm256_and_si256(_mm256_srli_epi16(l, 4), low4);
            const __m256i hb = C == 3 ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4 - 2 * C);
            const __m256i q = _mm256_or_si256(lo, _mm256_and_si256(hb, hi2));
            const __m256i scv = _mm256_shuffle_epi8(
                sc_eo, _mm256_set1_epi16(static_cast<int16_t>((2 * G) | ((2 * G + 1) << 8))));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
              isum[r] = dot2_i16<kVnni>(
                  isum[r], _mm256_maddubs_epi16(q, loadu_256(xb + r * K + 32 * G)), scv);
          }, std::make_index_sequence<4>{});
        }, std::make_index_sequence<2>{});
        const float d = fp16_to_float(blk + 208);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i qs16 = loadu_256(x.qsum16 + r * (K / 16) + 16 * b);
          const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc_all, qs16), 5);
          acc[r] += static_cast<float>(hsum_i32(_mm256_sub_epi32(isum[r], off))) *
                    (d * x.dx[r * nb + b]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) y[r * N + n] = acc[r];
  }
}

template <typename Q, int R, bool kVnni>
inline void few_rows(int rr, const FewRowsX& x, const uint8_t* w, int64_t row_bytes, int64_t n0,
                     int64_t n1, float* y, int64_t N) {
  if constexpr (R >= 1) {
    if (rr != R) return few_rows<Q, R - 1, kVnni>(rr, x, w, row_bytes, n0, n1, y, N);
    if constexpr (Q::kElems == 32) {
      few_rows_q32<Q, R, kVnni>(x, w, row_bytes, n0, n1, y, N);
    } else {
      few_rows_k<Q, R, kVnni>(x, w, row_bytes, n0, n1, y, N);
    }
  }
}

template <typename Q>
int32_t run_int8_few(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                     int64_t row_bytes, float* y, [[maybe_unused]] bool use_vnni,
                     int32_t num_threads) {
  std::unique_ptr<int16_t[]> xq(new (std::nothrow) int16_t[M * K]);
  std::unique_ptr<int8_t[]> q8(new (std::nothrow) int8_t[M * K]);
  std::unique_ptr<int16_t[]> bsum(new (std::nothrow) int16_t[M * (K / 32)]);
  std::unique_ptr<int16_t[]> qsum16(new (std::nothrow) int16_t[M * (K / 16)]);
  std::unique_ptr<float[]> dx(new (std::nothrow) float[M * (K / Q::kElems)]);
  if (!xq || !q8 || !bsum || !qsum16 || !dx) return kNoMemory;
  quantize_rows<Q>(x, M, K, xq.get(), dx.get(), bsum.get(), q8.get(), qsum16.get());
  if constexpr (kFewZmm && kHasMins<Q>) {  // each block's sub-blocks in the order 0 2 1 3 4 6 5 7
    constexpr int kOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    for (int64_t e = 0; e < M * K; e += 256)
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 32; ++i)
          q8[e + 32 * j + i] = static_cast<int8_t>(xq[e + 32 * kOrder[j] + i]);
  }
  const FewRowsX xs{q8.get(), dx.get(), bsum.get(), qsum16.get(), K};
  const int rr = static_cast<int>(M);
  const int64_t num_items = (N + kI8FewWork - 1) / kI8FewWork;
  // Threads only where each gets kFewRowsThreadWork weight elements x rows (a GEMV of a
  // 1024 x 3072 layer takes ~0.1 ms on one thread: splitting it cost more than it saved, 2
  // threads on a 2-vCPU Zen 4, Qwen3-0.6B-shaped Q4_K_M decode 21.8 -> 28.4 tok/s).
  const bool parallel = num_threads > 1 && num_items > 1 &&
                        N * K * M >= kFewRowsThreadWork * num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t i = 0; i < num_items; ++i) {
    const int64_t n0 = i * kI8FewWork, n1 = std::min(N, n0 + kI8FewWork);
#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512F__)
    if (use_vnni) {
      few_rows<Q, kI8FewRows, true>(rr, xs, w, row_bytes, n0, n1, y, N);
      continue;
    }
#endif
    few_rows<Q, kI8FewRows, false>(rr, xs, w, row_bytes, n0, n1, y, N);
  }
  return kOk;
}
#endif

template <typename Q>
int32_t run_int8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                 int64_t row_bytes, float* y, int32_t vnni, int32_t num_threads) {
  if (K <= 0 || K % Q::kElems != 0 || row_bytes != K / Q::kElems * Q::kBytes) return kBadIndex;
  if (vnni < -1 || vnni > 1) return kBadIndex;
  if (M == 0 || N == 0) return kOk;
#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512F__)
  const bool has_vnni = __builtin_cpu_supports("avx512vnni");
#else
  const bool has_vnni = false;  // the VNNI kernel exists in the avx512 build only
#endif
  if (vnni == 1 && !has_vnni) return kBadIndex;
  const bool use_vnni = vnni == 1 || (vnni == -1 && has_vnni);
#if ASYNCPAGED_VEC_BYTES >= 32 && defined(__AVX2__)
  if (M <= few_rows_limit<Q>(use_vnni)) return run_int8_few<Q>(x, M, K, w, N, row_bytes, y, use_vnni, num_threads);
#endif
  const int64_t num_groups = (N + W - 1) / W;
  const bool parallel = num_threads > 1 && num_groups > 1 && N * K * M >= kParallelWork;
  const int threads = parallel ? num_threads : 1;
  std::unique_ptr<int16_t[]> xq(new (std::nothrow) int16_t[M * K]);
  std::unique_ptr<int16_t[]> bsum(new (std::nothrow) int16_t[M * (K / 32)]);
  std::unique_ptr<float[]> dx(new (std::nothrow) float[M * (K / Q::kElems)]);
  std::unique_ptr<float[]> acc(new (std::nothrow) float[threads * M * W]);
  if (!xq || !bsum || !dx || !acc) return kNoMemory;
  std::unique_ptr<int8_t[]> q8;
  std::unique_ptr<int16_t[]> qsum16;
  if (use_vnni) {
    q8.reset(new (std::nothrow) int8_t[M * K]);
    qsum16.reset(new (std::nothrow) int16_t[M * (K / 16)]);
    if (!q8 || !qsum16) return kNoMemory;
  }
  quantize_rows<Q>(x, M, K, xq.get(), dx.get(), bsum.get(), q8.get(), qsum16.get());
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t g = 0; g < num_groups; ++g) {
#if defined(_OPENMP)
    float* a = acc.get() + static_cast<int64_t>(omp_get_thread_num()) * M * W;
#else
    float* a = acc.get();
#endif
#if ASYNCPAGED_VEC_BYTES >= 64 && defined(__AVX512F__)
    if (use_vnni) {
      vnni_groups<Q>(q8.get(), dx.get(), bsum.get(), qsum16.get(), M, K, w, N, row_bytes, y, a,
                     g);
      continue;
    }
#endif
    int8_groups<Q, false>(xq.get(), dx.get(), bsum.get(), M, K, w, N, row_bytes, y, a, g);
  }
  return kOk;
}

template <typename Q>
int32_t run(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
            float* y, int32_t path, int32_t num_threads) {
  if (K <= 0 || K % Q::kElems != 0 || row_bytes != K / Q::kElems * Q::kBytes) return kBadIndex;
  if (M == 0 || N == 0) return kOk;
  if (path == kAuto) path = M <= kGemvTile ? kGemv : kTiled;  // measured crossover (Zen 4)
  if (path != kGemv && path != kTiled) return kBadIndex;
  // x packed for the tiles (a copy of x, not of W); a single row needs none.
  std::unique_ptr<float[]> xp;
  if (M > 1) {
    const int64_t rows = path == kGemv ? (M + kGemvTile - 1) / kGemvTile * kGemvTile : M;
    xp.reset(new (std::nothrow) float[rows * K]);
    if (!xp) return kNoMemory;
  }
  if (path == kGemv) {
    gemv<Q>(x, M, K, w, N, row_bytes, xp.get(), y, num_threads);
  } else {
    tiled<Q>(x, M, K, w, N, row_bytes, xp.get(), y, num_threads);
  }
  return kOk;
}

}  // namespace

extern "C" {

// y [M, N] = x [M, K] @ dequantize(w)^T: x, y float32 contiguous; w [N, row_bytes] uint8, each
// row K / block_elems blocks of GGML type qtype (2 Q4_0, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K).
// path: 0 auto, 1 gemv, 2 tiled. Returns a Status (0 = ok; kBadDtype: unknown qtype; kBadIndex:
// K not a positive multiple of the block, row_bytes not K's, negative sizes or an unknown path;
// 8: no memory for the packed copy of x, M x K floats, made when M > 1).
int32_t asyncpaged_quant_matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                                int64_t row_bytes, int32_t qtype, float* y, int32_t path,
                                int32_t num_threads) {
  if (M < 0 || N < 0) return kBadIndex;
  switch (qtype) {
    case kQ8_0:
      return run<Q8_0>(x, M, K, w, N, row_bytes, y, path, num_threads);
    case kQ4_0:
      return run<Q4_0>(x, M, K, w, N, row_bytes, y, path, num_threads);
    case kQ4_K:
      return run<Q4_K>(x, M, K, w, N, row_bytes, y, path, num_threads);
    case kQ5_K:
      return run<Q5_K>(x, M, K, w, N, row_bytes, y, path, num_threads);
    case kQ6_K:
      return run<Q6_K>(x, M, K, w, N, row_bytes, y, path, num_threads);
    default:
      return kBadDtype;
  }
}

// y [M, N] = int8(x) @ dequantize(w)^T with x quantized per block as above (the opt-in int8
// activation path): arguments as asyncpaged_quant_matmul; vnni: -1 where the CPU has
// AVX512-VNNI (avx512 build only), 0 never, 1 always (kBadIndex where the CPU lacks it).
// Returns a Status (8: no memory for x's codes, M x K int16 and its scales).
int32_t asyncpaged_quant_matmul_int8(const float* x, int64_t M, int64_t K, const uint8_t* w,
                                     int64_t N, int64_t row_bytes, int32_t qtype, float* y,
                                     int32_t vnni, int32_t num_threads) {
  if (M < 0 || N < 0) return kBadIndex;
  switch (qtype) {
    case kQ8_0:
      return run_int8<Q8_0>(x, M, K, w, N, row_bytes, y, vnni, num_threads);
    case kQ4_0:
      return run_int8<Q4_0>(x, M, K, w, N, row_bytes, y, vnni, num_threads);
    case kQ4_K:
      return run_int8<Q4_K>(x, M, K, w, N, row_bytes, y, vnni, num_threads);
    case kQ5_K:
      return run_int8<Q5_K>(x, M, K, w, N, row_bytes, y, vnni, num_threads);
    case kQ6_K:
      return run_int8<Q6_K>(x, M, K, w, N, row_bytes, y, vnni, num_threads);
    default:
      return kBadDtype;
  }
}

// x's int8 codes as the int8 path makes them: q [M, K] int16 (in [-127, 127]), dx [M, K /
// block] float32 (block 32 or 256: a weight type's block). Returns a Status.
int32_t asyncpaged_quantize_activations(const float* x, int64_t M, int64_t K, int32_t block,
                                        int16_t* q, float* dx) {
  if (M < 0 || K <= 0 || (block != 32 && block != 256) || K % block != 0) return kBadIndex;
  std::unique_ptr<int16_t[]> bsum(new (std::nothrow) int16_t[M * (K / 32) + 1]);
  if (!bsum) return kNoMemory;
  if (block == 32) {
    quantize_rows<Q8_0>(x, M, K, q, dx, bsum.get());
  } else {
    quantize_rows<Q4_K>(x, M, K, q, dx, bsum.get());
  }
  return kOk;
}

}  // extern "C"
