// y[M, N] = x[M, K] @ W[N, K]^T with W kept as integer or fp8 codes times scales (the layouts of
// compressed-tensors' pack-quantized and float-quantized checkpoints) and x, y float32,
// contiguous. Weights are dequantized in registers, never as a matrix.
//
// Codes (row n of W is row_bytes bytes):
//
//   int8   K bytes:    u = q + 128                             w = (u - z) * s
//   int4   K / 2 bytes, per 32-element run r 16 bytes b[0..16):
//                      element r*32 + j: u = b[j] & 15, element r*32 + 16 + j: u = b[j] >> 4
//                      (q + 8; Q4_0's order: the loader reorders compressed-tensors' interleaved
//                      nibbles once)                          w = (u - z) * s
//   fp8    K bytes:    float8 e4m3fn (bias 7, no infinities, 0x7f/0xff NaN)   w = f * s
//
// s = scales[(n / row_block) * num_groups + (k >> group_shift)], z likewise from zeros (the zero
// point plus 2^(bits - 1), as float), or 2^(bits - 1) when zeros is null (symmetric). One scale
// covers a run of 32 elements at least (group_shift >= 5).
//
// Exactness: compressed-tensors dequantizes in the scale's dtype: (q - zp) * s computed in
// float32 and rounded to bf16 or fp16 when the scale is stored so. Here (u - z) is the same
// integer, f the same value (decoded with integer operations: no dependence on the FPU's
// denormal mode), the product the same float32 product (exact for bf16 and fp16 scales), and
// `round` rounds it as torch does (ties to even; fp16 subnormals and overflow included). So each
// weight is the float32 value compressed-tensors decompresses to, and the dot products
// accumulate those values in float32: x @ W.T up to the summation order alone.
//
// Two paths, as quant_matmul.cpp's (auto: gemv up to 2 kGemvTile rows):
//   gemv  (few rows, decode): each 32-element run of a W row is decoded once and multiplied into
//         up to kGemvTile rows of x (packed per pass, accumulators in registers).
//   tiled (prefill): for NT = 2 W columns of y and a K chunk of 256, the W tile is decoded once
//         into an L1 buffer ([k][NT]), then every MT-row tile of x runs a register-tiled
//         micro-kernel over it; y accumulates over the chunks in k order.
// Rows of W (gemv) or NT-column tiles (tiled) split over the threads, schedule static.

#include "cpu_vec.h"

#include <algorithm>
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

constexpr int kRun = 32;  // elements per decode run (one scale and zero)
constexpr int kVecsPerRun = kRun / W;
constexpr int kGemvTile = kNumRegs >= 32 ? 16 : 8;
constexpr int64_t kGemvRows = 8;  // rows of W per gemv work item
constexpr int kTileCols = 2 * W;
constexpr int kTileRows = kNumRegs >= 32 ? 12 : 6;
constexpr int kChunkK = 256;
constexpr int64_t kParallelWork = 1 << 16;
static_assert(kRun % W == 0 && 16 % W == 0, "a vector stays inside one half of a run");

enum Code : int32_t { kFp8E4M3 = 3, kInt4 = 4, kInt8 = 8 };
enum Round : int32_t { kRoundF32 = 0, kRoundBf16 = 1, kRoundF16 = 2 };
enum Path : int32_t { kAuto = 0, kGemv = 1, kTiled = 2 };
constexpr int32_t kNoMemory = 8;

template <typename F, size_t... I>
inline void unrolled(F&& f, std::index_sequence<I...>) {
  (f(std::integral_constant<int, static_cast<int>(I)>{}), ...);
}

// W bytes at p, zero-extended to W int32 lanes (intrinsics: GCC 12 scalarizes the generic form).
inline vi load_u8(const uint8_t* p) {
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

inline vf bits_to_vf(vu b) {
  vf f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline vu vf_to_bits(vf f) {
  vu b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// fp8 e4m3fn codes (in the low byte of each lane) -> float, exactly.
inline vf fp8_to_vf(vi code) {
  const vu u = (vu)code;
  const vu sign = (u & 0x80u) << 24;
  const vu e = (u >> 3) & 15u;
  const vu m = u & 7u;
  const vu normal = sign | ((e + 120u) << 23) | (m << 20);
  const vu sub = sign | vf_to_bits(__builtin_convertvector((vi)m, vf) * 0x1p-9f);  // m * 2^-9
  const vu is_sub = (vu)(e == 0u);
  const vu is_nan = (vu)((u & 0x7fu) == 0x7fu);
  const vu bits = (is_sub & sub) | (~is_sub & normal);
  return bits_to_vf((is_nan & (sign | 0x7fc00000u)) | (~is_nan & bits));
}

// float32 lanes rounded to the nearest fp16 value (ties to even, as torch's float -> half), kept
// as float32. The lanes are finite products, exact in float32.
inline vf round_f16(vf p) {
  const vu b = vf_to_bits(p);
  const vu a = b & 0x7fffffffu;
  const vu normal = (b + 0xfffu + ((b >> 13) & 1u)) & ~0x1fffu;  // 10 mantissa bits kept
  // below 2^-14 the fp16 grid is 2^-24: p * 2^24 is exact, and +- 1.5 * 2^23 rounds it to an
  // integer (ties to even); a contracted fma(p, 2^24, c) gives the same sum
  const vf t = p * 0x1p24f;
  const vu sub = vf_to_bits(((t + 0x1.8p23f) - 0x1.8p23f) * 0x1p-24f);
  const vu is_sub = (vu)(a < 0x38800000u);  // |p| < 2^-14
  const vu r = (is_sub & sub) | (~is_sub & normal);
  const vu over = (vu)((r & 0x7fffffffu) > 0x477fe000u);  // past 65504: infinity
  return bits_to_vf((over & ((r & 0x80000000u) | 0x7f800000u)) | (~over & r));
}

template <int32_t R>
inline vf round_to(vf p) {
  if constexpr (R == kRoundBf16) return round_bf16(p);
  if constexpr (R == kRoundF16) return round_f16(p);
  return p;
}

struct Weights {
  const uint8_t* w;
  int64_t row_bytes;
  const float* scales;  // [ceil(N / row_block), num_groups]
  const float* zeros;   // same, or null
  int64_t num_groups;
  int32_t group_shift;
  int64_t row_block;
};

// decode(run index r of row n, f) calls f(I, w) for the kVecsPerRun vectors of elements
// [32 r + I W, + W), I a compile-time index.
template <int32_t C, int32_t R>
struct Decoder {
  const Weights& p;
  static constexpr float kOffset = C == kInt4 ? 8.0f : 128.0f;

  // The scales (and zeros) of row n.
  inline const float* scale_row(int64_t n) const { return p.scales + n / p.row_block * p.num_groups; }
  inline const float* zero_row(int64_t n) const {
    return p.zeros == nullptr ? nullptr : p.zeros + n / p.row_block * p.num_groups;
  }

  template <typename F>
  inline void decode(const uint8_t* row, const float* srow, const float* zrow, int64_t r,
                     F&& f) const {
    const int64_t g = (r * kRun) >> p.group_shift;
    const float s = srow[g];
    if constexpr (C == kFp8E4M3) {
      const uint8_t* b = row + r * kRun;
      unrolled([&](auto i) {
        constexpr int I = decltype(i)::value;
        f(i, round_to<R>(fp8_to_vf(load_u8(b + I * W)) * s));
      }, std::make_index_sequence<kVecsPerRun>{});
    } else {
      const float z = zrow == nullptr ? kOffset : zrow[g];
      if constexpr (C == kInt8) {
        const uint8_t* b = row + r * kRun;
        unrolled([&](auto i) {
          constexpr int I = decltype(i)::value;
          const vf u = __builtin_convertvector(load_u8(b + I * W), vf);
          f(i, round_to<R>((u - z) * s));
        }, std::make_index_sequence<kVecsPerRun>{});
      } else {
        const uint8_t* b = row + r * (kRun / 2);
        unrolled([&](auto i) {
          constexpr int E = decltype(i)::value * W;
          const vi raw = load_u8(b + E % 16);
          const vf u = __builtin_convertvector(E >= 16 ? raw >> 4 : raw & 15, vf);
          f(i, round_to<R>((u - z) * s));
        }, std::make_index_sequence<kVecsPerRun>{});
      }
    }
  }
};

// ---- x packed per pass of rows: vector kv of row m at xp[m0 K + (kv mt + m) W].
void pack_gemv(const float* x, int64_t m0, int64_t mt, int64_t K, float* xp) {
  for (int64_t kv = 0; kv < K / W; ++kv)
    for (int64_t m = 0; m < mt; ++m)
      std::memcpy(xp + m0 * K + (kv * mt + m) * W, x + (m0 + m) * K + kv * W, W * sizeof(float));
}

// tiled layout of rows [m0, m0 + mt): x[m0 + m, k] at xp[m0 K + k mt + m].
void pack_tiled(const float* x, int64_t m0, int64_t mt, int64_t K, float* xp) {
  for (int64_t m = 0; m < mt; ++m)
    for (int64_t k = 0; k < K; ++k) xp[m0 * K + k * mt + m] = x[(m0 + m) * K + k];
}

template <int32_t C, int32_t R, int MT>
void gemv_rows(const Decoder<C, R>& d, const float* x, int64_t K, int64_t n0, int64_t n1,
               float* y, int64_t N) {
  constexpr int NA = std::min(kVecsPerRun, std::max(1, 4 / MT));  // independent FMA chains
  const int64_t num_runs = K / kRun;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = d.p.w + n * d.p.row_bytes;
    const float* srow = d.scale_row(n);
    const float* zrow = d.zero_row(n);
    vf acc[MT][NA];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int a = 0; a < NA; ++a) acc[m][a] = vf{};
    for (int64_t r = 0; r < num_runs; ++r) {
      const float* xr = x + r * kRun * MT;
      d.decode(row, srow, zrow, r, [&](auto i, vf wv) {
        constexpr int I = decltype(i)::value;
        const float* xk = xr + I * W * MT;
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) acc[m][I % NA] += load(xk + m * W) * wv;
      });
    }
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      vf s = acc[m][0];
#pragma GCC unroll 4
      for (int a = 1; a < NA; ++a) s += acc[m][a];
      y[m * N + n] = reduce_add(s);
    }
  }
}

template <int32_t C, int32_t R, int MT>
void gemv_dispatch(int mt, const Decoder<C, R>& d, const float* x, int64_t K, int64_t n0,
                   int64_t n1, float* y, int64_t N) {
  if constexpr (MT >= 1) {
    if (mt == MT) {
      gemv_rows<C, R, MT>(d, x, K, n0, n1, y, N);
    } else {
      gemv_dispatch<C, R, MT - 1>(mt, d, x, K, n0, n1, y, N);
    }
  }
}

inline int64_t pass_start(int64_t p, int64_t M, int64_t passes) { return p * M / passes; }

template <int32_t C, int32_t R>
void gemv(const Decoder<C, R>& d, const float* x, int64_t M, int64_t K, int64_t N, float* xp,
          float* y, int32_t num_threads) {
  const int64_t passes = (M + kGemvTile - 1) / kGemvTile;
  for (int64_t p = 0; p < passes && xp != nullptr; ++p) {
    const int64_t m0 = pass_start(p, M, passes);
    pack_gemv(x, m0, pass_start(p + 1, M, passes) - m0, K, xp);
  }
  const float* xs = xp != nullptr ? xp : x;
  const bool parallel = num_threads > 1 && N > 1 && N * K * M >= kParallelWork;
  const int64_t num_chunks = (N + kGemvRows - 1) / kGemvRows;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t n0 = c * kGemvRows, n1 = std::min(N, n0 + kGemvRows);
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t m0 = pass_start(p, M, passes);
      const int mt = static_cast<int>(pass_start(p + 1, M, passes) - m0);
      gemv_dispatch<C, R, kGemvTile>(mt, d, xs + m0 * K, K, n0, n1, y + m0 * N, N);
    }
  }
}

// wt[k * NT + c] = W[n0 + c, k0 + k] for k < kc, c < num_cols (columns past num_cols are zero).
template <int32_t C, int32_t R>
void pack_tile(const Decoder<C, R>& d, int64_t n0, int num_cols, int64_t k0, int64_t kc,
               float* wt) {
  for (int c = 0; c < kTileCols; ++c) {
    if (c >= num_cols) {
      for (int64_t k = 0; k < kc; ++k) wt[k * kTileCols + c] = 0.0f;
      continue;
    }
    const int64_t n = n0 + c;
    const uint8_t* row = d.p.w + n * d.p.row_bytes;
    const float* srow = d.scale_row(n);
    const float* zrow = d.zero_row(n);
    for (int64_t r = k0 / kRun; r < (k0 + kc) / kRun; ++r) {
      float* out = wt + (r * kRun - k0) * kTileCols + c;
      d.decode(row, srow, zrow, r, [&](auto i, vf wv) {
        constexpr int I = decltype(i)::value;
        float* o = out + I * W * kTileCols;
#pragma GCC unroll 16
        for (int l = 0; l < W; ++l) o[l * kTileCols] = wv[l];
      });
    }
  }
}

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
void micro_dispatch(int mt, const float* x, const float* wt, int64_t kc, float* y, int64_t N,
                    int num_cols, bool first) {
  if constexpr (MT >= 1) {
    if (mt == MT) {
      micro_kernel<MT>(x, wt, kc, y, N, num_cols, first);
    } else {
      micro_dispatch<MT - 1>(mt, x, wt, kc, y, N, num_cols, first);
    }
  }
}

template <int32_t C, int32_t R>
void tiled(const Decoder<C, R>& d, const float* x, int64_t M, int64_t K, int64_t N, float* xp,
           float* y, int32_t num_threads) {
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
      pack_tile(d, n0, num_cols, k0, kc, wt);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int mt = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        micro_dispatch<kTileRows>(mt, xs + m0 * K + k0 * mt, wt, kc, y + m0 * N + n0, N,
                                  num_cols, k0 == 0);
      }
    }
  }
}

template <int32_t C, int32_t R>
int32_t run(const Weights& p, const float* x, int64_t M, int64_t K, int64_t N, float* y,
            int32_t path, int32_t num_threads) {
  if (M == 0 || N == 0) return kOk;
  if (path == kAuto) path = M <= 2 * kGemvTile ? kGemv : kTiled;
  if (path != kGemv && path != kTiled) return kBadIndex;
  std::unique_ptr<float[]> xp;
  if (M > 1) {
    xp.reset(new (std::nothrow) float[M * K]);
    if (!xp) return kNoMemory;
  }
  const Decoder<C, R> d{p};
  if (path == kGemv) {
    gemv(d, x, M, K, N, xp.get(), y, num_threads);
  } else {
    tiled(d, x, M, K, N, xp.get(), y, num_threads);
  }
  return kOk;
}

template <int32_t C>
int32_t run_code(const Weights& p, const float* x, int64_t M, int64_t K, int64_t N, float* y,
                 int32_t round, int32_t path, int32_t num_threads) {
  switch (round) {
    case kRoundF32:
      return run<C, kRoundF32>(p, x, M, K, N, y, path, num_threads);
    case kRoundBf16:
      return run<C, kRoundBf16>(p, x, M, K, N, y, path, num_threads);
    case kRoundF16:
      return run<C, kRoundF16>(p, x, M, K, N, y, path, num_threads);
    default:
      return kBadDtype;
  }
}

// ---- int8 activations (opt-in) ----
//
// x is quantized per row and per block of B = 2^block_shift elements (B >= 32 and within one
// scale group): dx = max|x| / 127 (float32), q = round(x / dx) to nearest, ties to even (0 for an
// all-zero block), qsum = sum q. Each block's integer dot product with the weight row's unsigned
// codes u, sum u * q, is exact in int32; the zero point enters through the block's qsum:
//   y[m, n] = sum_b (dx[m, b] * s[n, g(b)]) * float(sum_j u_j q_j - z[n, g(b)] * qsum[m, b])
// with the scaling and the sum over blocks in float32 (in vector lanes: any order). s is the scale as stored (its bf16 / fp16
// value widened), z the integer zero point plus 2^(bits - 1). Dot products: vpdpbusd on
// AVX512-VNNI CPUs (avx512 build, detected at run time), pmaddwd on bytes widened to int16 in
// the avx2 build (exact: pmaddubsw would saturate int16 pairs of 8-bit codes), scalar otherwise;
// eight blocks' int32 vectors are reduced together by a hadd tree.
// int4 rows are unpacked to one byte per code once per row of W.

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t B, int8_t* q, float* dx,
                   int32_t* qsum) {
  const int64_t nb = K / B;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * B;
      float amax = 0.0f;
      for (int64_t j = 0; j < B; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f;
      int8_t* qb = q + m * K + b * B;
      int32_t sum = 0;
      for (int64_t j = 0; j < B; ++j) {
        const float v = d > 0.0f ? std::nearbyint(xb[j] / d) : 0.0f;
        const int32_t c = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
        qb[j] = static_cast<int8_t>(c);
        sum += c;
      }
      dx[m * nb + b] = d;
      qsum[m * nb + b] = sum;
    }
  }
}

void block_dots_scalar(const uint8_t* u, const int8_t* q, int64_t K, int64_t B, int32_t* out) {
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += B, ++b) {
    int32_t acc = 0;
    for (int64_t j = k0; j < k0 + B; ++j) acc += static_cast<int32_t>(u[j]) * q[j];
    out[b] = acc;
  }
}

#if defined(__AVX2__)
inline int32_t hsum256(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// The lane sums of a[0..8) as one vector [sum a0, ..., sum a7] (a hadd tree).
inline __m256i reduce8(const __m256i* a) {
  const __m256i s01 = _mm256_hadd_epi32(a[0], a[1]);
  const __m256i s23 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i s45 = _mm256_hadd_epi32(a[4], a[5]);
  const __m256i s67 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i s0123 = _mm256_hadd_epi32(s01, s23);
  const __m256i s4567 = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                          _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

// Block sums with dot(acc, u + j, q + j) adding 32 products of bytes j.. to an int32 vector;
// eight blocks reduced together.
template <typename Dot>
inline void block_dots_with(const uint8_t* u, const int8_t* q, int64_t K, int64_t B,
                            int32_t* out, Dot dot) {
  const int64_t nb = K / B;
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256i acc[8];
    for (int i = 0; i < 8; ++i) {
      acc[i] = _mm256_setzero_si256();
      for (int64_t j = (b + i) * B; j < (b + i + 1) * B; j += 32) acc[i] = dot(acc[i], u + j, q + j);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b), reduce8(acc));
  }
  for (; b < nb; ++b) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t j = b * B; j < (b + 1) * B; j += 32) acc = dot(acc, u + j, q + j);
    out[b] = hsum256(acc);
  }
}

void block_dots_avx2(const uint8_t* u, const int8_t* q, int64_t K, int64_t B, int32_t* out) {
  block_dots_with(u, q, K, B, out, [](__m256i acc, const uint8_t* a, const int8_t* c) {
    for (int h = 0; h < 32; h += 16) {
      const __m256i a16 =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + h)));
      const __m256i c16 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + h)));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(a16, c16));
    }
    return acc;
  });
}
#endif

#if defined(__AVX512F__)
// block_dots_with's loops with vpdpbusd (written out: a lambda of another target is not inlined).
__attribute__((target("avx512vnni,avx512vl"))) void block_dots_vnni(const uint8_t* u,
                                                                     const int8_t* q, int64_t K,
                                                                     int64_t B, int32_t* out) {
  const auto dot = [&](__m256i acc, int64_t j) {
    return _mm256_dpbusd_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + j)),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j)));
  };
  const int64_t nb = K / B;
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256i acc[8];
    for (int i = 0; i < 8; ++i) {
      acc[i] = _mm256_setzero_si256();
      for (int64_t j = (b + i) * B; j < (b + i + 1) * B; j += 32) acc[i] = dot(acc[i], j);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b), reduce8(acc));
  }
  for (; b < nb; ++b) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t j = b * B; j < (b + 1) * B; j += 32) acc = dot(acc, j);
    out[b] = hsum256(acc);
  }
}
#endif

using BlockDots = void (*)(const uint8_t*, const int8_t*, int64_t, int64_t, int32_t*);

BlockDots pick_block_dots() {
#if defined(__AVX512F__)
  if (__builtin_cpu_supports("avx512vnni")) return block_dots_vnni;
#endif
#if defined(__AVX2__)
  return block_dots_avx2;
#else
  return block_dots_scalar;
#endif
}

int32_t run_int8(const Weights& p, int32_t code, const float* x, int64_t M, int64_t K, int64_t N,
                 int32_t block_shift, float* y, int32_t num_threads) {
  if (M == 0 || N == 0) return kOk;
  const int64_t B = int64_t{1} << block_shift;
  const int64_t nb = K / B;
  std::unique_ptr<int8_t[]> q(new (std::nothrow) int8_t[M * K]);
  std::unique_ptr<float[]> dx(new (std::nothrow) float[M * nb]);
  std::unique_ptr<int32_t[]> qsum(new (std::nothrow) int32_t[M * nb]);
  if (!q || !dx || !qsum) return kNoMemory;
  quantize_rows(x, M, K, B, q.get(), dx.get(), qsum.get());
  const BlockDots dots = pick_block_dots();
  const float offset = code == kInt4 ? 8.0f : 128.0f;
  const bool parallel = num_threads > 1 && N > 1 && N * K * M >= kParallelWork;
  // per thread: a row's unpacked codes [K], block sums, scales and zeros [nb] each
  const int64_t per_thread = K + nb * 3 * 4;
  const int64_t team = parallel ? num_threads : 1;
  std::unique_ptr<uint8_t[]> scratch(new (std::nothrow) uint8_t[team * per_thread]);
  if (!scratch) return kNoMemory;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
#if defined(_OPENMP)
    uint8_t* buf = scratch.get() + omp_get_thread_num() * per_thread;
#else
    uint8_t* buf = scratch.get();
#endif
    int32_t* isum = reinterpret_cast<int32_t*>(buf + K);
    float* sb = reinterpret_cast<float*>(isum + nb);
    int32_t* zb = isum + 2 * nb;
    {
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = p.w + n * p.row_bytes;
        const uint8_t* u = row;
        if (code == kInt4) {
          for (int64_t r = 0; r < K / kRun; ++r) {
            const uint8_t* b = row + r * (kRun / 2);
            uint8_t* o = buf + r * kRun;
#if defined(__SSE2__)
            const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
            const __m128i mask = _mm_set1_epi8(15);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_and_si128(v, mask));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o + kRun / 2),
                             _mm_and_si128(_mm_srli_epi16(v, 4), mask));
#else
            for (int j = 0; j < kRun / 2; ++j) {
              o[j] = b[j] & 15;
              o[kRun / 2 + j] = b[j] >> 4;
            }
#endif
          }
          u = buf;
        }
        const int64_t srow = (n / p.row_block) * p.num_groups;
        for (int64_t b = 0; b < nb; ++b) {  // this row's scale and zero per block of x
          const int64_t g = p.group_shift >= 62 ? 0 : (b * B) >> p.group_shift;
          sb[b] = p.scales[srow + g];
          zb[b] = static_cast<int32_t>(p.zeros != nullptr ? p.zeros[srow + g] : offset);
        }
        for (int64_t m = 0; m < M; ++m) {
          int32_t* is = isum;
          dots(u, q.get() + m * K, K, B, is);
          const float* d = dx.get() + m * nb;
          const int32_t* qs = qsum.get() + m * nb;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t b = 0; b < nb; ++b) {
            acc += (d[b] * sb[b]) * static_cast<float>(is[b] - zb[b] * qs[b]);
          }
          y[m * N + n] = acc;
        }
      }
    }
  }
  return kOk;
}

}  // namespace

extern "C" {

// y [M, N] = x [M, K] @ dequantize(w)^T: x, y float32 contiguous; w [N, row_bytes] uint8 of
// `code` (3 fp8 e4m3fn, 4 int4, 8 int8; layouts above); scales (and zeros, null when symmetric
// and always for fp8) float32 [ceil(N / row_block), num_groups], num_groups = ceil(K /
// 2^group_shift); round: 0 none (float32 scales), 1 bf16, 2 fp16 (the scales' stored dtype);
// path: 0 auto, 1 gemv, 2 tiled. Returns a Status (0 ok; kBadDtype: unknown code or round;
// kBadIndex: K not a positive multiple of 32, row_bytes not K's, group_shift < 5, num_groups
// not K's, row_block < 1, negative sizes, zeros with fp8 or an unknown path; 8: no memory for
// the packed copy of x, M x K floats, made when M > 1).
int32_t asyncpaged_scaled_matmul(const float* x, int64_t M, int64_t K, const uint8_t* w,
                                 int64_t N, int64_t row_bytes, int32_t code, const float* scales,
                                 const float* zeros, int64_t num_groups, int32_t group_shift,
                                 int64_t row_block, int32_t round, float* y, int32_t path,
                                 int32_t num_threads) {
  if (M < 0 || N < 0 || K <= 0 || K % kRun != 0 || row_block < 1) return kBadIndex;
  if (group_shift < 5 || group_shift > 62) return kBadIndex;
  const int64_t want_groups = group_shift >= 62 ? 1 : ((K - 1) >> group_shift) + 1;
  if (num_groups != want_groups) return kBadIndex;
  const Weights p{w, row_bytes, scales, zeros, num_groups, group_shift, row_block};
  switch (code) {
    case kInt8:
      if (row_bytes != K) return kBadIndex;
      return run_code<kInt8>(p, x, M, K, N, y, round, path, num_threads);
    case kInt4:
      if (row_bytes != K / 2) return kBadIndex;
      return run_code<kInt4>(p, x, M, K, N, y, round, path, num_threads);
    case kFp8E4M3:
      if (row_bytes != K || zeros != nullptr) return kBadIndex;
      return run_code<kFp8E4M3>(p, x, M, K, N, y, round, path, num_threads);
    default:
      return kBadDtype;
  }
}


// The int8-activations product (layout above run_int8): the arguments of
// asyncpaged_scaled_matmul for int4 / int8 codes (fp8: kBadDtype), and block_shift, log2 of x's
// block (5 or more, at most group_shift, block dividing K). The scales are used as stored (no
// per-weight rounding: round is not taken). Returns a Status (8: no memory for x's codes).
int32_t asyncpaged_scaled_matmul_int8(const float* x, int64_t M, int64_t K, const uint8_t* w,
                                      int64_t N, int64_t row_bytes, int32_t code,
                                      const float* scales, const float* zeros, int64_t num_groups,
                                      int32_t group_shift, int64_t row_block, int32_t block_shift,
                                      float* y, int32_t num_threads) {
  if (M < 0 || N < 0 || K <= 0 || K % kRun != 0 || row_block < 1) return kBadIndex;
  if (group_shift < 5 || group_shift > 62) return kBadIndex;
  if (block_shift < 5 || block_shift > 30 || block_shift > group_shift) return kBadIndex;
  if (K % (int64_t{1} << block_shift) != 0) return kBadIndex;
  const int64_t want_groups = group_shift >= 62 ? 1 : ((K - 1) >> group_shift) + 1;
  if (num_groups != want_groups) return kBadIndex;
  const Weights p{w, row_bytes, scales, zeros, num_groups, group_shift, row_block};
  switch (code) {
    case kInt8:
      if (row_bytes != K) return kBadIndex;
      return run_int8(p, code, x, M, K, N, block_shift, y, num_threads);
    case kInt4:
      if (row_bytes != K / 2) return kBadIndex;
      return run_int8(p, code, x, M, K, N, block_shift, y, num_threads);
    default:
      return kBadDtype;
  }
}

}  // extern "C"
