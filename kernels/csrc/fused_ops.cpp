// Fused elementwise work of the Llama family on the CPU, fp32 or bf16: the residual add with
// RMSNorm, RoPE on q and k in place, and SiLU(gate) * up. Each replaces several torch ops (and as
// many passes over memory and Python calls) with one pass; the math is torch's, op for op:
//
//   add_rms_norm:  residual += x;  out = weight * (residual * (1 / sqrt(sum(residual^2) / H + eps)))
//   rms_norm:      the same without the add (the first layer's input norm)
//   rotary:        for i < D/2, a = x[i], b = x[i + D/2]:
//                    x[i]       = a * cos[i]       - b * sin[i]
//                    x[i + D/2] = b * cos[i + D/2] + a * sin[i + D/2]
//   silu_mul:      out = gate / (1 + exp(-gate)) * up
//
// bf16 (element type uint16_t; the norm and RoPE): every value is widened to fp32, and each result
// a torch bf16 op would store is rounded to bf16 where torch rounds it (round_to<T>): the residual
// sum, the normalised row before the weight multiplies it (the model's ``h.to(bf16)``), each RoPE
// product and the RoPE sum, and every stored output. The sum of squares and rsqrt stay fp32, as
// in torch's bf16 RMSNorm.
//
// Rounding: every product and quotient is the one torch rounds; what differs is the order of
// the sum of squares (W lanes x 4 partial sums, then the lanes, where torch's reduction keeps
// its own partial sums), FMA contraction of a product into the following add in fp32
// (-ffp-contract=fast, as in every kernel here; a bf16 rounding between them blocks it), and exp
// (the Cephes polynomial, about 1 ulp, where torch's vectorised exp is Sleef's, also about 1 ulp).
// All of these are within a few fp32 ulps of the torch ops before any bf16 rounding; a bf16 norm
// differs from torch's only where such an fp32 ulp crosses a bf16 rounding boundary (one bf16
// ulp, rarely). RoPE has neither a sum order nor an exp: in bf16 it stores torch's bits.
//
// Work decomposition: rows (tokens) or flat element ranges split over the threads (schedule
// static) when the call is big enough to pay for the OpenMP region; a decode step's calls run on
// the caller's thread.

#include "cpu_vec.h"

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kParallelElems = 1 << 16;  // fewer elements in the call: one thread

inline bool go_parallel(int num_threads, int64_t num_elems) {
  return num_threads > 1 && num_elems >= kParallelElems;
}

inline float hsum(vf v) {
  float s = 0.0f;
#pragma GCC unroll 16
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

// One row: optionally residual += x (stored back), then out = weight * (r * rstd).
template <typename T>
void norm_row(T* residual, const T* x, const T* weight, T* out, int64_t n, float eps) {
  vf acc[4] = {vf{}, vf{}, vf{}, vf{}};
  int64_t i = 0;
  if (x != nullptr) {
    for (; i + 4 * W <= n; i += 4 * W) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const vf r = round_to<T>(load(residual + i + j * W) + load(x + i + j * W));
        store(residual + i + j * W, r);
        acc[j] += r * r;
      }
    }
    for (; i + W <= n; i += W) {
      const vf r = round_to<T>(load(residual + i) + load(x + i));
      store(residual + i, r);
      acc[0] += r * r;
    }
  } else {
    for (; i + 4 * W <= n; i += 4 * W) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const vf r = load(residual + i + j * W);
        acc[j] += r * r;
      }
    }
    for (; i + W <= n; i += W) {
      const vf r = load(residual + i);
      acc[0] += r * r;
    }
  }
  float sum = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < n; ++i) {
    float r = to_float(residual[i]);
    if (x != nullptr) {
      r = round_to<T>(r + to_float(x[i]));
      residual[i] = convert<T>(r);
    }
    sum += r * r;
  }
  const float mean = sum / static_cast<float>(n);
  const float rstd = 1.0f / std::sqrt(mean + eps);
  const vf rv = splat(rstd);
  int64_t k = 0;
  for (; k + W <= n; k += W) {
    store(out + k, load(weight + k) * round_to<T>(load(residual + k) * rv));
  }
  for (; k < n; ++k) {
    out[k] = convert<T>(to_float(weight[k]) * round_to<T>(to_float(residual[k]) * rstd));
  }
}

// In place on one token's heads: x [num_heads, D] (head stride D), cos/sin [D].
template <typename T>
void rotary_heads(T* x, int64_t num_heads, int64_t D, const T* cos, const T* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    T* lo = x + h * D;
    T* hi = lo + half;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
      const vf a = load(lo + i), b = load(hi + i);
      store(lo + i, round_to<T>(a * load(cos + i)) - round_to<T>(b * load(sin + i)));
      store(hi + i, round_to<T>(b * load(cos + half + i)) + round_to<T>(a * load(sin + half + i)));
    }
    for (; i < half; ++i) {
      const float a = to_float(lo[i]), b = to_float(hi[i]);
      lo[i] = convert<T>(round_to<T>(a * to_float(cos[i])) - round_to<T>(b * to_float(sin[i])));
      hi[i] = convert<T>(round_to<T>(b * to_float(cos[half + i])) +
                         round_to<T>(a * to_float(sin[half + i])));
    }
  }
}

// exp(x) over the whole float range, about 1 ulp (the Cephes polynomial of vexp in cpu_vec.h):
// overflow gives inf, underflow goes through the subnormals to 0, NaN stays NaN. The scale 2^n
// is applied as two powers of two, each a normal float, so n may run from -150 to 128.
inline vf vexp_full(vf x) {
  const vf hi = splat(89.0f), lo = splat(-104.0f);
  vf xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  vf n;
  vf y = exp_reduced(xc, n);
  const vi ni = __builtin_convertvector(n, vi);
  const vi n1 = ni >> 1;
  const vi e1 = (n1 + 127) << 23, e2 = (ni - n1 + 127) << 23;
  vf s1, s2;
  std::memcpy(&s1, &e1, sizeof s1);
  std::memcpy(&s2, &e2, sizeof s2);
  y = (y * s1) * s2;
  return x == x ? y : x;  // NaN in, NaN out
}

inline vf silu_mul_vec(vf g, vf u) { return g / (1.0f + vexp_full(-g)) * u; }

// out[0, n) = silu(gate) * up; out may alias gate or up. The tail runs through one padded vector
// (the same math as the body, so every element rounds the same way).
void silu_mul_range(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(out + i, silu_mul_vec(load(gate + i), load(up + i)));
  if (i < n) {
    float g[W] = {}, u[W] = {}, o[W];
    const int64_t rest = n - i;
    std::memcpy(g, gate + i, static_cast<size_t>(rest) * sizeof(float));
    std::memcpy(u, up + i, static_cast<size_t>(rest) * sizeof(float));
    store(o, silu_mul_vec(load(g), load(u)));
    std::memcpy(out + i, o, static_cast<size_t>(rest) * sizeof(float));
  }
}

template <typename T>
void add_rms_norm(void* residual_p, int64_t residual_stride, const void* x_p, int64_t x_stride,
                  const void* weight_p, void* out_p, int64_t out_stride, int64_t num_rows,
                  int64_t hidden, float eps, int32_t num_threads) {
  T* residual = static_cast<T*>(residual_p);
  const T* x = static_cast<const T*>(x_p);
  const T* weight = static_cast<const T*>(weight_p);
  T* out = static_cast<T*>(out_p);
  auto row = [&](int64_t t) {
    norm_row(residual + t * residual_stride, x == nullptr ? nullptr : x + t * x_stride, weight,
             out + t * out_stride, hidden, eps);
  };
  if (go_parallel(num_threads, num_rows * hidden)) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < num_rows; ++t) row(t);
  } else {
    for (int64_t t = 0; t < num_rows; ++t) row(t);
  }
}

template <typename T>
void rotary(void* q_p, int64_t q_stride, int64_t q_heads, void* k_p, int64_t k_stride,
            int64_t k_heads, const void* cos_p, const void* sin_p, int64_t cs_stride,
            int64_t num_tokens, int64_t head_dim, int32_t num_threads) {
  T* q = static_cast<T*>(q_p);
  T* k = static_cast<T*>(k_p);
  const T* cos = static_cast<const T*>(cos_p);
  const T* sin = static_cast<const T*>(sin_p);
  auto token = [&](int64_t t) {
    const T* c = cos + t * cs_stride;
    const T* s = sin + t * cs_stride;
    rotary_heads(q + t * q_stride, q_heads, head_dim, c, s);
    if (k != nullptr) rotary_heads(k + t * k_stride, k_heads, head_dim, c, s);
  };
  if (go_parallel(num_threads, num_tokens * (q_heads + k_heads) * head_dim)) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < num_tokens; ++t) token(t);
  } else {
    for (int64_t t = 0; t < num_tokens; ++t) token(t);
  }
}

void silu_mul(const float* gate, const float* up, float* out, int64_t num_elems,
              int32_t num_threads) {
  if (!go_parallel(num_threads, num_elems)) {
    silu_mul_range(gate, up, out, num_elems);
    return;
  }
  // Chunks of whole vectors per thread; the last chunk takes the tail.
  const int64_t per = (num_elems / num_threads + W - 1) / W * W;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int c = 0; c < num_threads; ++c) {
    const int64_t begin = std::min<int64_t>(num_elems, c * per);
    const int64_t end = c == num_threads - 1 ? num_elems : std::min<int64_t>(num_elems, begin + per);
    if (begin < end) silu_mul_range(gate + begin, up + begin, out + begin, end - begin);
  }
}

}  // namespace

extern "C" {

// Every entry point takes dtype 0 (fp32: float tensors) or, but silu_mul, 1 (bf16: uint16_t
// bits); all its tensors have that dtype.

// out[t] = weight * norm(residual[t] (+= x[t] when x is not null)) for num_rows rows of width
// hidden; rows at the given strides (elements), each row contiguous. out must not alias x or
// residual. Returns a Status (0 = ok).
int32_t asyncpaged_add_rms_norm(void* residual, int64_t residual_stride, const void* x,
                                int64_t x_stride, const void* weight, void* out,
                                int64_t out_stride, int64_t num_rows, int64_t hidden, float eps,
                                int32_t num_threads, int32_t dtype) {
  if (hidden <= 0) return kBadHeadDim;
  if (dtype == 0) {
    add_rms_norm<float>(residual, residual_stride, x, x_stride, weight, out, out_stride,
                        num_rows, hidden, eps, num_threads);
  } else if (dtype == 1) {
    add_rms_norm<uint16_t>(residual, residual_stride, x, x_stride, weight, out, out_stride,
                           num_rows, hidden, eps, num_threads);
  } else {
    return kBadDtype;
  }
  return kOk;
}

// RoPE in place on q [T, q_heads, D] and k [T, k_heads, D] (heads contiguous within a token's
// row, tokens at the given strides) with cos/sin [T, D] (rows at cs_stride). k may be null.
int32_t asyncpaged_rotary(void* q, int64_t q_stride, int64_t q_heads, void* k, int64_t k_stride,
                          int64_t k_heads, const void* cos, const void* sin, int64_t cs_stride,
                          int64_t num_tokens, int64_t head_dim, int32_t num_threads,
                          int32_t dtype) {
  if (head_dim <= 0 || head_dim % 2 != 0) return kBadHeadDim;
  if (q_heads < 0 || k_heads < 0) return kBadHeads;
  if (dtype == 0) {
    rotary<float>(q, q_stride, q_heads, k, k_stride, k_heads, cos, sin, cs_stride, num_tokens,
                  head_dim, num_threads);
  } else if (dtype == 1) {
    rotary<uint16_t>(q, q_stride, q_heads, k, k_stride, k_heads, cos, sin, cs_stride,
                     num_tokens, head_dim, num_threads);
  } else {
    return kBadDtype;
  }
  return kOk;
}

// out = silu(gate) * up over num_elems contiguous elements; out may be gate or up. fp32 only: in
// bf16 the exp and the divide cost what torch's SiLU and multiply cost (measured 65 vs 60 us at
// 64 x 1376 on avx512, 1.4x slower on avx2), so bf16 models keep the torch ops.
int32_t asyncpaged_silu_mul(const void* gate, const void* up, void* out, int64_t num_elems,
                            int32_t num_threads, int32_t dtype) {
  if (dtype != 0) return kBadDtype;
  silu_mul(static_cast<const float*>(gate), static_cast<const float*>(up), static_cast<float*>(out),
           num_elems, num_threads);
  return kOk;
}

}  // extern "C"
