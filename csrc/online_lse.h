// The online log-sum-exp state of a row (or a column) of gaps d over the negatives, and the one
// merge step every fold goes through. A state keeps its running max m and Σe, Σe·d relative to
// it (e = exp(d − m)), plus Σd; when a larger max arrives the two sums are rescaled once.
//   update_row:  a row state takes in a tile's segment of that row        (row sweeps)
//   col_update:  every column's state takes in a tile's rows              (symmetric forward)
//   lse_merge:   two states of the same column, one per group, combined   (symmetric forward)
// All three move a state onto a new max with lse_rebase, so they rescale identically.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <limits>
#include <vector>

#include "loops.h"

namespace hnclip {

template <typename T>
inline T softplus(T x) {  // log(1 + e^x) without overflow; −inf → 0, NaN → NaN
  return x > T(0) ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x));
}

// Below this a float32 row's probabilities e^(d − softplus δ) ≤ e^δ are subnormals (e^−87 ≈ 1.6e−38):
// the backward then weights the row as the softmax over its negatives, e^(d − δ), times g·σ(δ),
// formed in logs (a bf16 batch under a loss scale keeps such rows' gradients). The same rule as
// epilogue.row_factors. Returns (what the gaps lose, the row's weight) through lse and w.
// Under a loss scale above a GradScaler's usual 2^16 (a float32 weight |w| ≥ 2^20, no label-smoothing
// shift) the loops form w·e^(d − lse) as a product whose e^(...) can be a float32 subnormal, or 0
// below e^−104, while the product is a normal number: a column made only of such entries flushed.
// Move 2^k of the weight into the exponent (lse − k·ln2, w·2^−k, k = ⌊log2 |w|⌋ ≤ 126): each
// e^(d − lse) ≤ 1 becomes ≤ 2^k, finite. At 2^60 a bf16 row under a 2^52 scale was still 2.3% off
// (an e^(...) near 2^-140 has 9 bits); a weight below 2^20 keeps its bits (and its row's).
template <typename T>
inline void lift_weight(T* lse, T* w) {
  if (!std::is_same<T, float>::value || !(std::fabs(*w) >= T(1048576.0)) || !std::isfinite(*w)) return;
  int e = 0;
  std::frexp(*w, &e);  // |w| = m·2^e, m in [½, 1)
  const int k = std::min(e - 1, 126);
  *lse = static_cast<T>(static_cast<double>(*lse) - k * 0.69314718055994530942);
  *w = std::ldexp(*w, -k);
}

template <typename T>
inline void row_factor(T delta, T g, bool shifted, T* lse, T* w) {
  const bool deep = std::is_same<T, float>::value && !shifted && delta < T(-87);
  if (!deep) {
    *lse = softplus<T>(delta);
    *w = g;
  } else {
    *lse = delta;
    const T log_sigmoid = delta - std::log1p(std::exp(delta));
    *w = std::copysign(std::exp(std::log(std::fabs(g)) + log_sigmoid), g);
  }
  if (!shifted) lift_weight<T>(lse, w);
}

// Online log-sum-exp state of one row: running max, Σe, Σe·d (both relative to m), Σd, and with
// false-negative masking the number of kept columns.
template <typename T>
struct LseState {
  T m = -std::numeric_limits<T>::infinity();
  T acc[4] = {T(0), T(0), T(0), T(0)};  // Σe, Σe·d, Σd, #kept (masked sweeps only)
};

// The merge step: the state (m, se, sw) takes in terms whose largest gap is m_in. It moves onto
// max(m, m_in), its two sums rescaled by e^(m − new max) when the max changed, and returns the
// reference the incoming terms' exponentials are taken against: the new max, or 0 when every
// gap so far is −inf (no −inf − −inf).
template <typename T>
inline T lse_rebase(T& m, T& se, T& sw, T m_in) {
  const T new_m = std::max(m, m_in);
  const T safe = (new_m == -std::numeric_limits<T>::infinity()) ? T(0) : new_m;  // no −inf − −inf
  if (m != new_m) {
    const T rescale = std::exp(m - safe);
    se *= rescale;
    sw *= rescale;
  }
  m = new_m;
  return safe;
}

// Merge state 2 into state 1: both moved onto the common max, then summed.
template <typename T>
inline void lse_merge(T& m, T& se, T& sw, T& sd, T m2, T se2, T sw2, T sd2) {
  const T m1 = m;
  lse_rebase(m, se, sw, m2);
  lse_rebase(m2, se2, sw2, m1);
  se += se2;
  sw += sw2;
  sd += sd2;
}

// Fold the n columns z[0..n) of one row into st, skipping column `excl` (the positive); with
// masking only the columns the row keeps: g[0..n) the caption cosines of the same columns, column
// j kept unless g[j] >= thr, a NaN cosine kept (without masking g = z, not read; see loops.h keep())
template <typename T, bool kMasked>
void update_row(const T* z, const T* g, int64_t n, int64_t excl, T p, T thr, LseState<T>& st) {
  const int64_t n1 = (excl >= 0 && excl < n) ? excl : n;  // [0, n1) and [n1 + 1, n)
  const int64_t n2 = n1 < n ? n - n1 - 1 : 0;
  if (n1 + n2 == 0) return;
  T tmax = -std::numeric_limits<T>::infinity();
  if (n1 > 0) tmax = std::max(tmax, seg_max<T, kMasked>(z, g, n1, p, thr));
  if (n2 > 0) tmax = std::max(tmax, seg_max<T, kMasked>(z + n1 + 1, g + n1 + 1, n2, p, thr));
  const T safe = lse_rebase(st.m, st.acc[0], st.acc[1], tmax);
  if (n1 > 0) seg_sums<T, kMasked>(z, g, n1, p, safe, thr, st.acc);
  if (n2 > 0) seg_sums<T, kMasked>(z + n1 + 1, g + n1 + 1, n2, p, safe, thr, st.acc);
}

// delta = LSE of the gaps, mean_neg = Σ softmax(d)·d, dsum = Σ d
template <typename T>
void finish_row(const LseState<T>& st, T* delta, T* mean_neg, T* dsum) {
  const T sum = st.acc[0];
  if (sum > T(0)) {
    *delta = st.m + std::log(sum);
    *mean_neg = st.acc[1] / sum;
  } else {
    // a NaN anywhere in the row poisons Σe: keep it visible in the loss; no negatives: −inf
    *delta = (sum != sum) ? sum : -std::numeric_limits<T>::infinity();
    *mean_neg = T(0);
  }
  *dsum = st.acc[2];
}

template <typename T>
struct ColStats {  // online LSE state of every column: max, Σe, Σe·d (relative to max), Σd[, #kept]
  std::vector<T> m, se, sw, sd, sc;
  explicit ColStats(int64_t n, bool masked = false)
      : m(n, -std::numeric_limits<T>::infinity()), se(n, T(0)), sw(n, T(0)), sd(n, T(0)), sc(masked ? n : 0, T(0)) {}
};

// Fold a (rows × nb) tile (leading dimension ld), columns [n0, n0 + nb), into the column
// states; row r's excluded entry (the positive) is at tile column diag + r. With masking only
// the columns' kept entries: g the caption-cosine tile (same layout as z; without masking g = z,
// not read), an entry kept unless g >= thr (keep()). scratch: 6·nb, with or without masking (the counts' row tc
// is passed either way, written with masking only).
template <typename T, bool kMasked>
void col_update(const T* z, const T* g, int64_t ld, int64_t rows, int64_t nb, int64_t diag, const T* pc,
                ColStats<T>& cs, int64_t n0, T thr, T* scratch) {
  T* tmax = scratch;
  T* safe = scratch + nb;
  T* ts = scratch + 2 * nb;
  T* tw = scratch + 3 * nb;
  T* td = scratch + 4 * nb;
  T* tc = scratch + 5 * nb;  // kept counts (masking only)
  std::fill(tmax, tmax + nb, -std::numeric_limits<T>::infinity());
  auto segments = [&](int64_t r, int64_t& n1, int64_t& n2) {
    const int64_t excl = diag + r;
    n1 = (excl >= 0 && excl < nb) ? excl : nb;  // [0, n1) and [n1 + 1, nb)
    n2 = n1 < nb ? nb - n1 - 1 : 0;
  };
  for (int64_t r = 0; r < rows; ++r) {
    int64_t n1, n2;
    segments(r, n1, n2);
    const T* zr = z + r * ld;
    const T* gr = g + r * ld;
    if (n1 > 0) col_max<T, kMasked>(zr, gr, pc, n1, tmax, thr);
    if (n2 > 0) col_max<T, kMasked>(zr + n1 + 1, gr + n1 + 1, pc + n1 + 1, n2, tmax + n1 + 1, thr);
  }
  T* m = cs.m.data() + n0;
  T* se = cs.se.data() + n0;
  T* sw = cs.sw.data() + n0;
  T* sd = cs.sd.data() + n0;
  for (int64_t j = 0; j < nb; ++j) safe[j] = lse_rebase(m[j], se[j], sw[j], tmax[j]);
  std::fill(ts, ts + (kMasked ? 4 : 3) * nb, T(0));  // ts, tw, td[, tc]: this tile's sums, added to the state once
  for (int64_t r = 0; r < rows; ++r) {
    int64_t n1, n2;
    segments(r, n1, n2);
    const T* zr = z + r * ld;
    const T* gr = g + r * ld;
    if (n1 > 0) col_sums<T, kMasked>(zr, gr, pc, safe, n1, ts, tw, td, tc, thr);
    if (n2 > 0)
      col_sums<T, kMasked>(zr + n1 + 1, gr + n1 + 1, pc + n1 + 1, safe + n1 + 1, n2, ts + n1 + 1, tw + n1 + 1,
                           td + n1 + 1, tc + n1 + 1, thr);
  }
  for (int64_t j = 0; j < nb; ++j) {
    se[j] += ts[j];
    sw[j] += tw[j];
    sd[j] += td[j];
  }
  if constexpr (kMasked) {
    T* sc = cs.sc.data() + n0;
    for (int64_t j = 0; j < nb; ++j) sc[j] += tc[j];
  }
}

}  // namespace hnclip
