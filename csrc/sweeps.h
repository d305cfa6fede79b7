// The passes over the logit tiles (tiles.h), built on the online LSE (online_lse.h).
//
//   row sweep  (parallel over tile-rows / strips of them; each row owned by one task)
//     Sweep::kStats (no grad needed): tile by tile, online LSE along the row, over the
//       negatives: delta = LSE d, mean_neg = Σ softmax(d)·d, dsum = Σ d.
//     Sweep::kShares (with grad): the task keeps its (rows × N) strip of Z, finishes the row
//       statistics, turns the strip into P_ik = w_i·exp(d_ik − softplus(delta_i)) (0 at the
//       positive) and applies two BLAS products:
//         row_acc_I = P_I k̂                  (negatives' share of dL/dq̂ · τ, g = w)
//         col_acc  += P_Iᵀ q̂_I               (negatives' share of dL/dk̂ · τ)
//       The key accumulator is per *group* of strips (a contiguous split of the rows,
//       one group per thread, at most 1 + 256 MiB / (N·D·sizeof) groups) and the groups
//       are summed in group order afterwards, so results are bit-identical from run to run
//       for a given thread count (and agree to rounding across thread counts).
//     Sweep::kBackward (backward recompute): the same strips from the same tiles,
//       P_ik = w_i exp(d_ik − nll_i) with the saved nll. The backward needs it only when the
//       upstream gradient is not the same for every row (with a uniform g, the forward's
//       unweighted col_acc times g is the exact answer and nothing is recomputed).
//   symmetric forward / backward (the single-process loss, M = N, offset 0): one tile
//     serves i2t (its rows) and t2i (its columns); see "Symmetric single-process kernels".
// False-negative masking is a compile-time flag of every pass too (kMasked, see loops.h), made
// from the runtime one by MASK_SWITCH in one place per pass: RowSweep::run, symmetric_stats,
// symmetric_grads.
#pragma once

#include <cstring>
#include <vector>

#include "online_lse.h"
#include "tiles.h"

// MASK_SWITCH(cond, [&] { ... kMasked ... }): runs the lambda with constexpr bool kMasked = cond
// (one instantiation per value; flash-attention's BOOL_SWITCH).
#define MASK_SWITCH(COND, ...)         \
  [&] {                                \
    if (COND) {                        \
      constexpr bool kMasked = true;   \
      return __VA_ARGS__();            \
    } else {                           \
      constexpr bool kMasked = false;  \
      return __VA_ARGS__();            \
    }                                  \
  }()

namespace hnclip {

enum class Sweep { kStats, kShares, kBackward };

template <typename T, Sweep kMode>
struct RowSweep {
  Tensor L, R;        // (M, Dl), (N, Dl): Z = L Rᵀ (1/τ folded into L)
  Tensor qh, kh;      // (M, D), (N, D)
  const T* pos;       // (M,) Z_i,pos
  int64_t offset;
  T* delta = nullptr;         // kStats, kShares: the statistics' outputs
  T* mean_neg = nullptr;
  T* dsum = nullptr;
  const T* nll_in = nullptr;  // kBackward: the saved nll = softplus(delta)
  const T* weight = nullptr;  // kBackward: per-row factor of P (the upstream gradient)
  Tensor row_acc, col_acc;    // kShares, kBackward: col_acc always, row_acc when defined
  // false-negative masking (masked): the captions' factors GL = â, GR = b̂ (G = GL GRᵀ), the
  // threshold, kStats/kShares: kept counts out and ε (kShares: P − ε/n_i); kBackward: shift = ε/n_i
  bool masked = false;
  Tensor GL, GR;
  T thr = T(0), eps = T(0);
  T* kept = nullptr;
  const T* shift = nullptr;
  // group-id masking (masked sweeps; has_groups false: the caption tiles as formed)
  bool has_groups = false;
  GroupMask groups;
  // kStats, kShares: the rows' statistics over columns outside this sweep (the family's symmetric
  // tile), (4, M): delta, mean_neg, dsum, kept; null: none. The outputs are then the merged
  // statistics over both column sets, and kShares' P is normalised over both (its merged LSE, ε
  // over the merged kept classes), so the shares are the ones the merged loss needs.
  const T* prior = nullptr;

  // row i's statistics merged with the prior's: delta = logaddexp, mean_neg the softmax-weighted
  // mean of both, dsum and (masked) kept added; no negative in either (delta −inf): mean_neg 0
  template <bool kMasked>
  void merge_prior(int64_t i, int64_t M) const {
    const T d1 = prior[i], d2 = delta[i];
    const T hi = d1 > d2 ? d1 : d2;
    T d = hi;
    if (d1 != d1 || d2 != d2) {
      d = d1 + d2;  // NaN stays visible
    } else if (hi != -std::numeric_limits<T>::infinity()) {
      d = hi + std::log1p(std::exp(-std::abs(d1 - d2)));
    }
    mean_neg[i] = d == -std::numeric_limits<T>::infinity()
                      ? T(0)
                      : std::exp(d1 - d) * prior[M + i] + std::exp(d2 - d) * mean_neg[i];
    delta[i] = d;
    dsum[i] = prior[2 * M + i] + dsum[i];
    if constexpr (kMasked) kept[i] = prior[3 * M + i] + kept[i];
  }

  void run() {  // the one point where the runtime masking flag becomes the compile-time kMasked
    MASK_SWITCH(masked, [&] { sweep<kMasked>(); });
  }

  template <bool kMasked>
  void sweep() {
    const int64_t M = L.size(0), N = R.size(0), D = kh.size(1);
    if (M == 0) {
      if constexpr (kMode != Sweep::kStats) col_acc.zero_();
      return;
    }
    const TileGrid grid(M, N);
    const auto opts = L.options();
    if constexpr (kMode == Sweep::kStats) {  // one tile-row per task, no strip
      at::parallel_for(0, grid.tiles, 1, [&](int64_t t0, int64_t t1) {
        Tensor scratch = grid.scratch(opts);
        for (int64_t t = t0; t < t1; ++t) {
          block<kMasked>(grid, t * grid.tr, grid.rows_of(t), nullptr, scratch, nullptr, true);
        }
      });
    } else {
      grouped_strips<T>(grid, D, col_acc, opts,
                        [&](int64_t i0, int64_t rows, Tensor& strip, Tensor& scratch, Tensor& part, bool first) {
                          block<kMasked>(grid, i0, rows, &strip, scratch, &part, first);
                        });
    }
  }

  // rows [i0, i0 + rows) of the queries, whole tile-rows; strip (>= rows, N) and part (the group's
  // key accumulator) null for kStats
  template <bool kMasked>
  void block(const TileGrid& grid, int64_t i0, int64_t rows, Tensor* strip, Tensor& scratch, Tensor* part,
             bool first_in_group) {
    constexpr bool kForward = kMode != Sweep::kBackward;
    [[maybe_unused]] const int64_t M = L.size(0);
    constexpr bool kKeepG = kMasked && kMode == Sweep::kShares;  // the strip's caption cosines, for P below
    const int64_t N = grid.N;
    T* bp = kMode != Sweep::kStats ? strip->data_ptr<T>() : nullptr;  // leading dimension N
    Tensor gstrip = kKeepG ? at::empty({rows, std::max<int64_t>(N, 1)}, scratch.options()) : Tensor();
    T* gsp = kKeepG ? gstrip.data_ptr<T>() : bp;  // without masking g = z (see loops.h)
    std::vector<LseState<T>> st(kForward ? rows : 0);
    sweep_strip<T, kMasked>(grid, L, R, GL, GR, i0, rows, scratch,
                            [&](int64_t r, int64_t i, int64_t n0, int64_t nb, const T* z, const T* g) {
      if constexpr (kForward) {  // statistics, and (kShares) the logits kept for P below
        update_row<T, kMasked>(z, g, nb, offset + i - n0, pos[i], thr, st[r]);
        if constexpr (kMode == Sweep::kShares) {
          std::memcpy(bp + r * N + n0, z, static_cast<size_t>(nb) * sizeof(T));
          if constexpr (kKeepG) std::memcpy(gsp + r * N + n0, g, static_cast<size_t>(nb) * sizeof(T));
        }
      } else {  // P_ik = w_i exp(d_ik − nll_i) straight from the tile; masked: w_i (P_ik − ε/n_i), kept columns
        const T s = kMasked ? shift[i] : T(0);
        seg_prob<T, kMasked>(z, g, bp + r * N + n0, nb, pos[i], nll_in[i], weight[i], s, thr);
      }
    }, has_groups ? &groups : nullptr);
    if constexpr (kForward) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        finish_row<T>(st[r], delta + i, mean_neg + i, dsum + i);
        if constexpr (kMasked) kept[i] = st[r].acc[3];
        if (prior != nullptr) merge_prior<kMasked>(i, M);
        if constexpr (kMode == Sweep::kShares) {  // P_ik = w_i exp(d_ik − softplus(delta_i)), w = 1
          T* zr = bp + r * N;
          // masked: P_ik − ε/n_i on the kept columns
          const T s = kMasked && eps != T(0) ? eps / (kept[i] + T(1)) : T(0);
          seg_prob<T, kMasked>(zr, gsp + r * N, zr, N, pos[i], softplus<T>(delta[i]), T(1), s, thr);
        }
      }
    }
    if constexpr (kMode != Sweep::kStats) block_gemms(i0, rows, N, bp, strip, part, first_in_group);
  }

  // the strip's GEMMs: P (0 at the positive) against the keys into row_acc, and Pᵀ against the
  // queries into the group's key accumulator
  void block_gemms(int64_t i0, int64_t rows, int64_t N, T* bp, Tensor* strip, Tensor* part, bool first_in_group) {
    for (int64_t r = 0; r < rows; ++r) {  // 0 at the positive
      const int64_t pc = offset + i0 + r;
      if (pc >= 0 && pc < N) bp[r * N + pc] = T(0);
    }
    const Tensor probs = strip->narrow(0, 0, rows);
    if (row_acc.defined()) {
      Tensor out = row_acc.narrow(0, i0, rows);
      at::mm_out(out, probs, kh);
    }
    const Tensor qi = qh.narrow(0, i0, rows);
    if (first_in_group) {
      at::mm_out(*part, probs.t(), qi);
    } else {
      part->addmm_(probs.t(), qi);
    }
  }
};

// ---------------------------------------------------------------------------------------
// Symmetric single-process kernels: N images against N texts, positives on the diagonal.
// Z = L R̂ᵀ with L = (v̂ + γ t̂)/τ, R = t̂ serves both directions: i2t rows are the rows of Z,
// t2i rows are its columns (Z'_ji = (t̂_j·v̂_i + γ t̂_j·t̂_i)/τ = Z_ij), so each tile is computed
// once for both.
//   forward  (stats only, one product): tile-rows are owned by one task (online LSE along the
//     row, as in the row sweep); columns get an online LSE state per *group* of tile-rows (a
//     contiguous split of the tile-rows), folded tile by tile in tile-row order, and the groups'
//     states are merged in group order: bit-identical reruns for a given thread count, extra
//     memory 4·N numbers per group.
//   backward (three products): a strip's tiles are recomputed on the same grid, turned into
//       ds_ij = g_i P_ij + g_j P'_ji   (0 on the diagonal: the positives are in the epilogue)
//     and dv̂_I = ds_I t̂, dt̂ += ds_Iᵀ v̂_I (per-group accumulators summed in group order).
// Against two directional calls (three products each) this is four products instead of six.
// ---------------------------------------------------------------------------------------
// False-negative masking of the symmetric sweeps (null: none): a pair whose captions' cosine
// t̂_i · t̂_k is ≥ thr is no negative in either direction (t̂: the normalised ``captions`` when
// given, else the kernel's t̂ itself). The forward counts each row's and
// column's kept negatives into kept_r / kept_c; the backward takes each direction's smoothing
// share of a row, s = ε / n (s_r, s_c).
template <typename T>
struct SymMask {
  T thr;
  T* kept_r = nullptr;
  T* kept_c = nullptr;
  const T* s_r = nullptr;
  const T* s_c = nullptr;
  Tensor captions;  // undefined: the caption tile is formed from R = t̂
  // the hard-negative family's group ids (null: none): pairs whose ids agree are no negatives in
  // either direction (the ids mask is symmetric, as the threshold's); cos false: ids alone, no
  // caption tile formed (threshold +inf)
  const GroupMask* groups = nullptr;
  const Tensor& factor(const Tensor& R) const { return captions.defined() ? captions : R; }
};

template <typename T>
void symmetric_stats(const Tensor& L, const Tensor& R, const T* pos, T* delta_r, T* mean_r, T* dsum_r, T* delta_c,
                     T* mean_c, T* dsum_c, const SymMask<T>* mask = nullptr) {
  const int64_t N = R.size(0);
  if (N == 0) return;
  const TileGrid grid(N, N);
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t groups = std::min(threads, grid.tiles);
  const int64_t bn = grid.bn;
  std::vector<ColStats<T>> cols;
  cols.reserve(groups);
  for (int64_t g = 0; g < groups; ++g) cols.emplace_back(N, mask != nullptr);
  // the one point where the runtime masking flag becomes the compile-time kMasked
  MASK_SWITCH(mask != nullptr, [&] {
    const T thr = kMasked ? mask->thr : T(0);
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      Tensor scratch = grid.scratch(L.options());
      // masking forms the caption tile G = t̂_I t̂_Kᵀ beside each logit tile (same grid); without, g = z
      Tensor gscratch = kMasked ? grid.scratch(L.options()) : scratch;
      const T* sp = scratch.data_ptr<T>();
      const T* gp = gscratch.data_ptr<T>();
      std::vector<T> col_scratch(6 * bn);
      std::vector<LseState<T>> st(grid.tr);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t first = g * grid.tiles / groups, last = (g + 1) * grid.tiles / groups;
        for (int64_t t = first; t < last; ++t) {
          const int64_t i0 = t * grid.tr, rows = grid.rows_of(t);
          std::fill(st.begin(), st.end(), LseState<T>());
          for (int64_t n0 = 0; n0 < N; n0 += bn) {
            const int64_t nb = std::min(bn, N - n0);
            form_tile(L, R, i0, rows, n0, nb, scratch);
            if constexpr (kMasked) {
              if (mask->groups == nullptr || mask->groups->cos)
                form_tile(mask->factor(R), mask->factor(R), i0, rows, n0, nb, gscratch);
              if (mask->groups != nullptr) mask->groups->template apply<T>(i0, rows, n0, nb, bn, gscratch.data_ptr<T>());
            }
            for (int64_t r = 0; r < rows; ++r) {
              update_row<T, kMasked>(sp + r * bn, gp + r * bn, nb, i0 + r - n0, pos[i0 + r], thr, st[r]);
            }
            col_update<T, kMasked>(sp, gp, bn, rows, nb, i0 - n0, pos + n0, cols[g], n0, thr, col_scratch.data());
          }
          for (int64_t r = 0; r < rows; ++r) {
            finish_row<T>(st[r], delta_r + i0 + r, mean_r + i0 + r, dsum_r + i0 + r);
            if constexpr (kMasked) mask->kept_r[i0 + r] = st[r].acc[3];
          }
        }
      }
    });
  });
  // merge the groups' column states in group order
  at::parallel_for(0, N, 1024, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      LseState<T> st;
      st.m = cols[0].m[j];
      st.acc[0] = cols[0].se[j];
      st.acc[1] = cols[0].sw[j];
      st.acc[2] = cols[0].sd[j];
      T count = mask ? cols[0].sc[j] : T(0);
      for (int64_t g = 1; g < groups; ++g) {
        lse_merge(st.m, st.acc[0], st.acc[1], st.acc[2], cols[g].m[j], cols[g].se[j], cols[g].sw[j], cols[g].sd[j]);
        if (mask) count += cols[g].sc[j];
      }
      finish_row<T>(st, delta_c + j, mean_c + j, dsum_c + j);
      if (mask) mask->kept_c[j] = count;
    }
  });
}

// Negatives' shares (times τ) of dL/dv̂ and dL/dt̂; each direction's rows i: what its gaps lose,
// nll (softplus(delta)), and its weight w (the upstream gradient g_i), or for a row whose
// probabilities are float32 subnormals (δ, g_i·σ(δ_i)) (row_factor in online_lse.h).
// ds_ij = g_i P_ij + g_j P'_ji; with masking g_i (P_ij − s_i) + g_j (P'_ji − s'_j) on the kept
// entries and 0 on the masked ones.
template <typename T>
void symmetric_grads(const Tensor& L, const Tensor& R, const Tensor& vh, const T* pos, const T* nll_r, const T* nll_c,
                     const T* w_r, const T* w_c, Tensor& d_v, Tensor& d_t, const SymMask<T>* mask = nullptr) {
  const int64_t N = R.size(0), D = R.size(1);
  if (N == 0) return;
  const TileGrid grid(N, N);
  // the one point where the runtime masking flag becomes the compile-time kMasked
  MASK_SWITCH(mask != nullptr, [&] {
    const Tensor& G = kMasked ? mask->factor(R) : R;  // without masking not read
    const T thr = kMasked ? mask->thr : T(0);
    grouped_strips<T>(grid, D, d_t, L.options(),
                      [&](int64_t i0, int64_t rows, Tensor& strip, Tensor& scratch, Tensor& part, bool first) {
      T* bp = strip.data_ptr<T>();
      sweep_strip<T, kMasked>(grid, L, R, G, G, i0, rows, scratch,
                              [&](int64_t r, int64_t i, int64_t n0, int64_t nb, const T* z, const T* gt) {
        const T s_i = kMasked ? mask->s_r[i] : T(0);
        const T* s_c = kMasked ? mask->s_c + n0 : nullptr;
        sym_prob<T, kMasked>(z, gt, bp + r * N + n0, nb, pos[i], nll_r[i], w_r[i], s_i, pos + n0, nll_c + n0,
                             w_c + n0, s_c, thr);
      }, kMasked ? mask->groups : nullptr);
      for (int64_t r = 0; r < rows; ++r) bp[r * N + i0 + r] = T(0);
      const Tensor ds = strip.narrow(0, 0, rows);
      Tensor dv = d_v.narrow(0, i0, rows);
      at::mm_out(dv, ds, R);
      const Tensor vi = vh.narrow(0, i0, rows);
      if (first) {
        at::mm_out(part, ds.t(), vi);
      } else {
        part.addmm_(ds.t(), vi);
      }
    });
  });
}

}  // namespace hnclip
