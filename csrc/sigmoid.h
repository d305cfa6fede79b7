// The sigmoid (SigLIP) loss kind, beside online_lse.h (the softmax kind): a pair's loss
// softplus(x) with x = −y·z, and its logit gradient σ(z) − [y = 1] = −y·σ(x), both from one
// e = exp(−|x|) ∈ (0, 1]:
//     softplus(x) = max(x, 0) + log1p(e),   σ(x) = 1/(1 + e) for x ≥ 0, e/(1 + e) below,
// so a saturated positive (z = 20: x = −20) keeps its true gradient −σ(−z) ≈ −2e-9 instead of
// the σ(z) − 1 = 0 a float32 subtraction gives. No N×N buffer: the sweeps (sigmoid_pairs.cpp)
// feed one row segment of one tile at a time.
//
// A segment arrives as its scores S_j = s·w_j (s folded into the left factor, so z = S + b is
// one addition) and labels y_j ∈ {+1, −1, 0} (0: masked, no loss and no gradient), both built
// by SigmoidLabels::row from the tiles.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "loops.h"  // exp_of, kSimd, HNCLIP_INLINE

namespace hnclip {

// log(1 + e) for e ∈ [0, 1] (NaN in NaN out), branch-free so loops vectorise: 2·atanh(t) with
// t = e/(2 + e) ≤ 1/3, its series through t^15 (truncation < 2e-9 relative; near e = 0 the
// result is e itself, no cancellation).
HNCLIP_INLINE float log1p_unit_f32(float e) {
  const float t = e / (2.0f + e);
  const float t2 = t * t;
  float p = 1.0f / 15.0f;
  p = p * t2 + 1.0f / 13.0f;
  p = p * t2 + 1.0f / 11.0f;
  p = p * t2 + 1.0f / 9.0f;
  p = p * t2 + 1.0f / 7.0f;
  p = p * t2 + 1.0f / 5.0f;
  p = p * t2 + 1.0f / 3.0f;
  return 2.0f * t + 2.0f * t * (t2 * p);
}

template <typename T>
HNCLIP_INLINE T log1p_unit(T e) {
  if constexpr (std::is_same_v<T, float>) {
    return log1p_unit_f32(e);
  } else {
    return std::log1p(e);
  }
}

// One pair: its loss softplus(x) and its logit gradient −y·σ(x) (0 and 0 when masked, y = 0:
// selected, so a masked NaN stays out)
template <typename T>
HNCLIP_INLINE void sigmoid_pair(T S, T y, T b, T& loss, T& grad) {
  const T x = -y * (S + b);
  const T e = exp_of<T>(-std::abs(x));
  const T sp = (x > T(0) ? x : T(0)) + log1p_unit<T>(e);
  const T sg = (x >= T(0) ? T(1) : e) / (T(1) + e);
  loss = y != T(0) ? sp : T(0);
  grad = y != T(0) ? -y * sg : T(0);
}

// out[0] += Σ softplus(x_j), out[1] += Σ dz_j·S_j, out[2] += Σ dz_j over a row segment
// (dz = σ(z) − [y = 1]): the row's loss and its shares of dL/ds (times s) and dL/db
template <typename T>
HNCLIP_INLINE void sigmoid_sums_body(const T* S, const T* y, int64_t n, T b, T* out) {
  T sl = T(0), ss = T(0), sb = T(0);
#pragma omp simd if(simd : kSimd<T>) reduction(+ : sl, ss, sb)
  for (int64_t j = 0; j < n; ++j) {
    T loss, grad;
    sigmoid_pair<T>(S[j], y[j], b, loss, grad);
    const T term = y[j] != T(0) ? grad * S[j] : T(0);  // a masked ±inf score stays out
    sl += loss;
    ss += term;
    sb += grad;
  }
  out[0] += sl;
  out[1] += ss;
  out[2] += sb;
}

// out_j ← w·dz_j (w = g_i·s: dS of the row segment, s folded for the feature products)
template <typename T>
HNCLIP_INLINE void sigmoid_ds_body(const T* S, const T* y, int64_t n, T b, T w, T* out) {
#pragma omp simd if(simd : kSimd<T>)
  for (int64_t j = 0; j < n; ++j) {
    T loss, grad;
    sigmoid_pair<T>(S[j], y[j], b, loss, grad);
    out[j] = y[j] != T(0) ? w * grad : T(0);
  }
}

// float32: the AVX-512 / AVX2 / baseline clones in sigmoid_pairs.cpp (as loops.cpp's)
void sigmoid_sums_f32(const float* S, const float* y, int64_t n, float b, float* out);
void sigmoid_ds_f32(const float* S, const float* y, int64_t n, float b, float w, float* out);

template <typename T>
inline void sigmoid_sums(const T* S, const T* y, int64_t n, T b, T* out) {
  if constexpr (kSimd<T>) sigmoid_sums_f32(S, y, n, b, out);
  else sigmoid_sums_body<T>(S, y, n, b, out);
}

template <typename T>
inline void sigmoid_ds(const T* S, const T* y, int64_t n, T b, T w, T* out) {
  if constexpr (kSimd<T>) sigmoid_ds_f32(S, y, n, b, w, out);
  else sigmoid_ds_body<T>(S, y, n, b, w, out);
}

// The labels and scores of row i's segment [n0, n0 + nb) of the columns k̂ = [captions (C);
// negatives]: y = +1 at the positive offset + i, whose score is pos[i] (s·v̂_i·k̂_{offset+i}, no
// margin, formed once on the host); with group ids on each caption column j < C of the row's group
// +1 (positive) or 0 (masked), the positives' score the margin-free tile u (without a margin the
// logit tile z is margin-free itself); −1 elsewhere, score z.
template <typename T>
struct SigmoidLabels {
  const T* pos = nullptr;
  int64_t offset = 0, C = 0;
  const int64_t* qg = nullptr;  // (R,), (C,) group ids, null: none
  const int64_t* kg = nullptr;
  bool positive = false;  // same group: positive (else masked)

  void row(int64_t i, int64_t n0, int64_t nb, const T* z, const T* u, T* S, T* y) const {
    for (int64_t j = 0; j < nb; ++j) {
      S[j] = z[j];
      y[j] = T(-1);
    }
    if (qg != nullptr) {
      const int64_t id = qg[i], j1 = std::min(n0 + nb, C);
      for (int64_t j = n0; j < j1; ++j) {
        if (kg[j] != id) continue;
        y[j - n0] = positive ? T(1) : T(0);
        if (positive) S[j - n0] = u[j - n0];
      }
    }
    const int64_t p = offset + i - n0;
    if (p >= 0 && p < nb) {
      S[p] = pos[i];
      y[p] = T(1);
    }
  }
};

}  // namespace hnclip
