// Row argmax of fp32 or bf16 logits on the CPU: per row, the first index of its largest value
// (the lowest id among ties, -0 == +0), or of its first NaN where it has one: what
// torch.argmax(x, dim=-1) answers. A bf16 model's greedy rows take it on the head's bf16 logits
// directly, where the alternative is widening the whole [rows, vocab] block to fp32 first.
//
// Each row is scanned in kAcc x W lanes: every lane keeps its largest value and that value's
// first index (a strict > only ever moves a lane to a later, larger value), then the lanes
// reduce to the largest value's smallest index, and the tail runs scalar. A NaN seen in the
// row sends it to a scalar scan for the first NaN.
//
// Work decomposition: rows split over the threads (schedule static) when the call is large
// enough to pay for the OpenMP region.

#include "cpu_vec.h"

#include <cstdint>
#include <limits>
#include <utility>

namespace {

constexpr int64_t kParallelElems = 1 << 18;  // fewer elements in the call: one thread

template <size_t... I>
inline vi lane_ids(std::index_sequence<I...>) {
  return vi{static_cast<int32_t>(I)...};
}

template <typename T>
int64_t first_nan(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    if (v != v) return i;
  }
  return -1;
}

constexpr int kAcc = 4;  // independent lane sets: a compare-and-blend chain per set, not one

// n < 2^31 (the entry point checks).
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  int64_t best_i = 0;
  float best = to_float(x[0]);
  int64_t i = 0;
  if (n >= kAcc * W) {
    // Set a holds elements a*W + [0, W) of every kAcc*W-element stretch.
    vf vbest[kAcc];
    vi vbest_i[kAcc];
    vi nan = vi{};
    const vi lanes = lane_ids(std::make_index_sequence<W>{});
    for (int a = 0; a < kAcc; ++a) {
      vbest[a] = load(x + a * W);
      vbest_i[a] = lanes + a * W;
      nan |= vbest[a] != vbest[a];
    }
    for (i = kAcc * W; i + kAcc * W <= n; i += kAcc * W) {
#pragma GCC unroll 4
      for (int a = 0; a < kAcc; ++a) {
        const vf v = load(x + i + a * W);
        const vi better = v > vbest[a];
        vbest[a] = better ? v : vbest[a];
        vbest_i[a] = better ? lanes + static_cast<int32_t>(i + a * W) : vbest_i[a];
        nan |= v != v;
      }
    }
    for (int l = 0; l < W; ++l) {
      if (nan[l] != 0) return first_nan(x, n);
    }
    best = vbest[0][0];
    best_i = vbest_i[0][0];
    for (int a = 0; a < kAcc; ++a) {
      for (int l = 0; l < W; ++l) {
        const float v = vbest[a][l];
        const int64_t at = vbest_i[a][l];
        if (v > best || (v == best && at < best_i)) {
          best = v;
          best_i = at;
        }
      }
    }
  } else if (best != best) {
    return 0;
  } else {
    i = 1;
  }
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    if (v != v) return i;  // every earlier value was a number (else it returned above)
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  return best_i;
}

template <typename T>
void argmax_rows(const void* x_p, int64_t num_rows, int64_t num_cols, int64_t row_stride,
                 int64_t* out, int32_t num_threads) {
  const T* x = static_cast<const T*>(x_p);
  if (num_threads > 1 && num_rows > 1 && num_rows * num_cols >= kParallelElems) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < num_rows; ++r) out[r] = row_argmax(x + r * row_stride, num_cols);
  } else {
    for (int64_t r = 0; r < num_rows; ++r) out[r] = row_argmax(x + r * row_stride, num_cols);
  }
}

}  // namespace

extern "C" {

// out[r] = argmax of row r of x [num_rows, num_cols] (rows at row_stride elements, each row
// contiguous); dtype 0 = fp32, 1 = bf16. 0 < num_cols < 2^31. Returns a Status (0 = ok).
int32_t asyncpaged_argmax_rows(const void* x, int32_t dtype, int64_t num_rows, int64_t num_cols,
                               int64_t row_stride, int64_t* out, int32_t num_threads) {
  if (num_cols <= 0 || num_cols > std::numeric_limits<int32_t>::max() || num_rows < 0) {
    return kBadIndex;
  }
  if (dtype == 0) {
    argmax_rows<float>(x, num_rows, num_cols, row_stride, out, num_threads);
  } else if (dtype == 1) {
    argmax_rows<uint16_t>(x, num_rows, num_cols, row_stride, out, num_threads);
  } else {
    return kBadDtype;
  }
  return kOk;
}

}  // extern "C"
