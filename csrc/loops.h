// Vectorised inner loops: the only code that touches every logit of a tile. Each loop is written
// once, as an always-inline template body; float32 calls reach it through the thin wrappers in
// loops.cpp, which GCC builds as AVX-512 / AVX2 / baseline clones (target_clones) and picks one
// at load time (ifunc), so the extension needs no -march flag. float64 is the accuracy path
// (tests, gradcheck): the same bodies, inlined, kept scalar (`if(simd: ...)` below) with std::exp.
//
// The tiles hold the logits themselves, Z = (L/τ) Rᵀ (1/τ is folded into the left factor), so
// every loop below forms a gap as ONE subtraction, d = z − p. There is no z·s − p for the
// compiler to contract into an FMA in some loops and clones and not in others: with the product
// separate, GCC fused it (one rounding) in the statistics loops of the AVX2 clone but not in
// sym_prob (z·s used twice), so at |Z| ≈ 1e8 the backward's gaps differed from the forward's by an
// ulp (2-8), a factor up to e^8 on P. The forward and backward must see bit-identical gaps.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace hnclip {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HNCLIP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HNCLIP_CLONES
#endif
// The bodies are inlined into each clone, so each clone compiles them for its own instruction set.
#define HNCLIP_INLINE inline __attribute__((always_inline))

// e^x in float32, relative error < 1e-7 on normal results, correct gradual underflow
// (0 below −104), +inf above 89, NaN in NaN out. Written branch-free so loops vectorise.
HNCLIP_INLINE float exp_f32(float x) {
  float xc = x < -104.0f ? -104.0f : x;
  xc = xc > 89.0f ? 89.0f : xc;
  const float t = xc * 1.44269504088896341f;
  float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  n = (n == n) ? n : 0.0f;                    // NaN: keep the int conversion defined
  float r = xc - n * 0.693359375f;            // Cody-Waite: r = x − n·ln2
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500E-4f;  // Cephes expf polynomial
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  const int32_t k = static_cast<int32_t>(n);
  const int32_t k1 = k >> 1, k2 = k - k1;  // two factors: 2^k for k in [−151, 129]
  const uint32_t b1 = static_cast<uint32_t>(k1 + 127) << 23;
  const uint32_t b2 = static_cast<uint32_t>(k2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof(float));
  std::memcpy(&s2, &b2, sizeof(float));
  return p * s1 * s2;
}

// Vectorise (and reorder the reductions) for float32 only: float64 keeps plain sequential loops.
template <typename T>
constexpr bool kSimd = std::is_same_v<T, float>;

template <typename T>
HNCLIP_INLINE T exp_of(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_f32(x);
  } else {
    return std::exp(x);
  }
}

// ---- False-negative masking: one compile-time flag, kMasked -------------------------------
// Each loop is written once for both: with kMasked it runs over the columns a row keeps, column
// j kept unless its caption cosine g[j] (the caption-caption tile, laid out as z) is at or above
// thr: a NaN cosine (a NaN or ±inf caption) is kept, so its NaN logit reaches the LSE and the
// loss is NaN exactly when the gradients are (`g < thr` would drop it from the forward, while the
// backward's products with that caption, 0·NaN, still make the gradients NaN). A
// masked column counts nowhere: no term of the LSE, of Σd, no probability; the row sums also
// count the kept columns, and P less its label-smoothing share s is what a masked row's dS holds.
// Without masking keep() is the constant true, the smoothing share and the counts are compiled
// out (`if constexpr`), g and thr are never read (callers pass g = z, a valid pointer laid out
// like z), and each loop performs exactly the operations of the plain loop: bit-identical results.
template <bool kMasked, typename T>
HNCLIP_INLINE bool keep(const T* g, int64_t j, T thr) {
  if constexpr (kMasked) {
    return !(g[j] >= thr);  // for a finite cosine the same as g[j] < thr
  } else {
    return true;
  }
}

// e less a row's label-smoothing share s with masking; e itself without (no share)
template <bool kMasked, typename T>
HNCLIP_INLINE T less_share(T e, T s) {
  if constexpr (kMasked) {
    return e - s;
  } else {
    return e;
  }
}

// ---- Row loops: one row of a tile, one positive p ----------------------------------------

// max_j (z_j − p) over the kept columns
template <typename T, bool kMasked>
HNCLIP_INLINE T seg_max_body(const T* z, const T* g, int64_t n, T p, T thr) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd if(simd : kSimd<T>) reduction(max : m)
  for (int64_t j = 0; j < n; ++j) {
    const T d = keep<kMasked>(g, j, thr) ? z[j] - p : -std::numeric_limits<T>::infinity();
    m = d > m ? d : m;
  }
  return m;
}

// Σ e, Σ e·d, Σ d with d = z − p, e = exp(d − m) over the kept columns, added to out[0..3);
// masked: #kept added to out[3]
template <typename T, bool kMasked>
HNCLIP_INLINE void seg_sums_body(const T* z, const T* g, int64_t n, T p, T m, T thr, T* out) {
  T se = T(0), sw = T(0), sd = T(0), sc = T(0);
#pragma omp simd if(simd : kSimd<T>) reduction(+ : se, sw, sd, sc)
  for (int64_t j = 0; j < n; ++j) {
    const bool kept = keep<kMasked>(g, j, thr);
    const T d = kept ? z[j] - p : T(0);
    const T e = kept ? exp_of<T>(d - m) : T(0);
    se += e;
    sw += e * d;
    sd += d;
    if constexpr (kMasked) sc += kept ? T(1) : T(0);
  }
  out[0] += se;
  out[1] += sw;
  out[2] += sd;
  if constexpr (kMasked) out[3] += sc;
}

// out ← w · exp((z − p) − shift) on the kept columns, 0 on the masked ones (out may be z);
// masked: w · (exp(...) − s), dS of a row with label smoothing spread over its kept classes
// (s = ε / n_i)
template <typename T, bool kMasked>
HNCLIP_INLINE void seg_prob_body(const T* z, const T* g, T* out, int64_t n, T p, T shift, T w, T s, T thr) {
#pragma omp simd if(simd : kSimd<T>)
  for (int64_t j = 0; j < n; ++j) {
    const T d = z[j] - p;
    out[j] = keep<kMasked>(g, j, thr) ? w * less_share<kMasked>(exp_of<T>(d - shift), s) : T(0);
  }
}

// ---- Column loops of the symmetric kernels ------------------------------------------------
// Vectorised across the columns j of one row of a tile, with a per-column positive p_j
// (d_j = z_j − p_j), so the column statistics (the t2i rows of Zᵀ) come from the same
// row-major tile as the row statistics.

// mx_j ← max(mx_j, d_j) on the kept columns
template <typename T, bool kMasked>
HNCLIP_INLINE void col_max_body(const T* z, const T* g, const T* p, int64_t n, T* mx, T thr) {
#pragma omp simd if(simd : kSimd<T>)
  for (int64_t j = 0; j < n; ++j) {
    const T d = keep<kMasked>(g, j, thr) ? z[j] - p[j] : -std::numeric_limits<T>::infinity();
    mx[j] = d > mx[j] ? d : mx[j];
  }
}

// se_j += e, sw_j += e·d, sd_j += d with e = exp(d − m_j) on the kept columns; masked: sc_j += 1
// on them (sc is not read without masking)
template <typename T, bool kMasked>
HNCLIP_INLINE void col_sums_body(const T* z, const T* g, const T* p, const T* m, int64_t n, T* se, T* sw, T* sd,
                                 T* sc, T thr) {
#pragma omp simd if(simd : kSimd<T>)
  for (int64_t j = 0; j < n; ++j) {
    const bool kept = keep<kMasked>(g, j, thr);
    const T d = kept ? z[j] - p[j] : T(0);
    const T e = kept ? exp_of<T>(d - m[j]) : T(0);
    se[j] += e;
    sw[j] += e * d;
    sd[j] += d;
    if constexpr (kMasked) sc[j] += kept ? T(1) : T(0);
  }
}

// out_j ← w·exp((z_j − p) − shift) + wc_j·exp((z_j − pc_j) − shc_j): row i's softmax over its
// negatives plus column j's (the transposed direction's) at the same logit, on the kept columns
// (out may be z); masked: each direction's softmax less its smoothing share (s, sc_j; not read
// without masking). One expression for both: its shape decides which product GCC contracts into
// an FMA, and the unmasked one must stay the plain sum of two products.
template <typename T, bool kMasked>
HNCLIP_INLINE void sym_prob_body(const T* z, const T* g, T* out, int64_t n, T p, T shift, T w, T s, const T* pc,
                                 const T* shc, const T* wc, const T* sc, T thr) {
#pragma omp simd if(simd : kSimd<T>)
  for (int64_t j = 0; j < n; ++j) {
    const T zj = z[j];
    const T v = w * less_share<kMasked>(exp_of<T>((zj - p) - shift), s) +
                wc[j] * less_share<kMasked>(exp_of<T>((zj - pc[j]) - shc[j]), kMasked ? sc[j] : T(0));
    out[j] = keep<kMasked>(g, j, thr) ? v : T(0);
  }
}

// ---- float32 entry points (loops.cpp: one target_clones wrapper around each body, built for
// kMasked false and true) -------------------------------------------------------------------
template <bool kMasked>
float seg_max_f32(const float* z, const float* g, int64_t n, float p, float thr);
template <bool kMasked>
void seg_sums_f32(const float* z, const float* g, int64_t n, float p, float m, float thr, float* out);
template <bool kMasked>
void seg_prob_f32(const float* z, const float* g, float* out, int64_t n, float p, float shift, float w, float s,
                  float thr);
template <bool kMasked>
void col_max_f32(const float* z, const float* g, const float* p, int64_t n, float* mx, float thr);
template <bool kMasked>
void col_sums_f32(const float* z, const float* g, const float* p, const float* m, int64_t n, float* se, float* sw,
                  float* sd, float* sc, float thr);
template <bool kMasked>
void sym_prob_f32(const float* z, const float* g, float* out, int64_t n, float p, float shift, float w, float s,
                  const float* pc, const float* shc, const float* wc, const float* sc, float thr);

// ---- What the kernels call: the float32 clones, or the float64 body inlined ----------------
template <typename T, bool kMasked>
inline T seg_max(const T* z, const T* g, int64_t n, T p, T thr) {
  if constexpr (kSimd<T>) return seg_max_f32<kMasked>(z, g, n, p, thr);
  else return seg_max_body<T, kMasked>(z, g, n, p, thr);
}
template <typename T, bool kMasked>
inline void seg_sums(const T* z, const T* g, int64_t n, T p, T m, T thr, T* out) {
  if constexpr (kSimd<T>) seg_sums_f32<kMasked>(z, g, n, p, m, thr, out);
  else seg_sums_body<T, kMasked>(z, g, n, p, m, thr, out);
}
template <typename T, bool kMasked>
inline void seg_prob(const T* z, const T* g, T* out, int64_t n, T p, T shift, T w, T s, T thr) {
  if constexpr (kSimd<T>) seg_prob_f32<kMasked>(z, g, out, n, p, shift, w, s, thr);
  else seg_prob_body<T, kMasked>(z, g, out, n, p, shift, w, s, thr);
}
template <typename T, bool kMasked>
inline void col_max(const T* z, const T* g, const T* p, int64_t n, T* mx, T thr) {
  if constexpr (kSimd<T>) col_max_f32<kMasked>(z, g, p, n, mx, thr);
  else col_max_body<T, kMasked>(z, g, p, n, mx, thr);
}
template <typename T, bool kMasked>
inline void col_sums(const T* z, const T* g, const T* p, const T* m, int64_t n, T* se, T* sw, T* sd, T* sc, T thr) {
  if constexpr (kSimd<T>) col_sums_f32<kMasked>(z, g, p, m, n, se, sw, sd, sc, thr);
  else col_sums_body<T, kMasked>(z, g, p, m, n, se, sw, sd, sc, thr);
}
template <typename T, bool kMasked>
inline void sym_prob(const T* z, const T* g, T* out, int64_t n, T p, T shift, T w, T s, const T* pc, const T* shc,
                     const T* wc, const T* sc, T thr) {
  if constexpr (kSimd<T>) sym_prob_f32<kMasked>(z, g, out, n, p, shift, w, s, pc, shc, wc, sc, thr);
  else sym_prob_body<T, kMasked>(z, g, out, n, p, shift, w, s, pc, shc, wc, sc, thr);
}

}  // namespace hnclip
