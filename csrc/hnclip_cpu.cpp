// Fused HN-CLIP loss on CPU: the C++ counterpart of hnclip_kernels/ops/hn_clip_triton.py.
//
// One direction at a time: M query rows against N key columns, positive of row i at
// column offset + i, negatives everywhere else. With q̂ = rq·q, k̂ = rk·k, â = ra·a,
// b̂ = rb·b (float32, or float64 for float64 inputs; the Python side hands in q̂ and k̂):
//
//     Z_ik = (q̂_i·k̂_k + γ â_i·b̂_k) / τ,   d_ik = Z_ik − pos_i   (k ≠ offset + i)
//
// The logits are produced tile by tile with one BLAS product per tile, Z = L_I R_Kᵀ, 1/τ folded
// into L (so a gap d = z − pos is one subtraction, the same in every loop and every clone):
//   * b̂ == k̂ (i2t: b and k are both the texts):  L = (q̂ + γ â)/τ, R = k̂
//   * â == q̂ (t2i: a and q are both the texts):  L = q̂/τ,         R = k̂ + γ b̂
//   * otherwise                                  L = [q̂, γ â]/τ,  R = [k̂, b̂]   (inner dim 2D)
// so the margin costs nothing in the usual i2t/t2i calls. Nothing of size M×N is stored:
// extra memory is O(N·D) (the factors above, per-group key accumulators) plus one
// (rows × N) strip per task.
//
// Every pass forms its tiles on one grid (TileGrid: tile-rows of 16-128 query rows, 512 key
// columns) with one routine (form_tile), whatever the pass and the thread count: a backward
// sees bit for bit the logits the forward's statistics came from. It has to: at |Z| ≈ 1e8 an
// ulp of Z is 8, a factor e^8 on P = exp(Z − LSE) if the backward's logit rounds otherwise.
//
// Kernels
//   row sweep  (parallel over tile-rows / strips of them; each row owned by one task)
//     stats only (no grad needed): tile by tile, online LSE along the row, over the
//       negatives: delta = LSE d, mean_neg = Σ softmax(d)·d, dsum = Σ d.
//     with grad: the task keeps its (rows × N) strip of Z, finishes the row statistics,
//       turns the strip into P_ik = w_i·exp(d_ik − softplus(delta_i)) (0 at the
//       positive) and applies two BLAS products:
//         row_acc_I = P_I k̂                  (negatives' share of dL/dq̂ · τ, g = w)
//         col_acc  += P_Iᵀ q̂_I               (negatives' share of dL/dk̂ · τ)
//       The key accumulator is per *group* of strips (a contiguous split of the rows,
//       one group per thread, at most 1 + 256 MiB / (N·D·sizeof) groups) and the groups
//       are summed in group order afterwards, so results are bit-identical from run to run
//       for a given thread count (and agree to rounding across thread counts).
//     backward recompute: the same strips from the same tiles, P_ik = w_i exp(d_ik − nll_i)
//       with the saved nll. The backward needs it only when the upstream gradient is not the
//       same for every row (with a uniform g, the forward's unweighted col_acc times g is the
//       exact answer and nothing is recomputed).
//   symmetric forward / backward (the single-process loss, M = N, offset 0): one tile
//     serves i2t (its rows) and t2i (its columns); see "Symmetric single-process kernels".
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <tuple>
#include <vector>

namespace hnclip {
namespace {

using at::Tensor;

// ---------------------------------------------------------------------------------------
// Vectorised inner loops. GCC builds AVX-512 / AVX2 clones of the float32 loops and picks
// one at load time (ifunc), so the extension needs no -march flag.
// ---------------------------------------------------------------------------------------
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HNCLIP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HNCLIP_CLONES
#endif

// e^x in float32, relative error < 1e-7 on normal results, correct gradual underflow
// (0 below −104), +inf above 89, NaN in NaN out. Written branch-free so loops vectorise.
static inline float exp_f32(float x) {
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

// The tiles hold the logits themselves, Z = (L/τ) Rᵀ (1/τ is folded into the left factor), so
// every loop below forms a gap as ONE subtraction, d = z − p. There is no z·s − p for the
// compiler to contract into an FMA in some loops and clones and not in others: with the product
// separate, GCC fused it (one rounding) in the statistics loops of the AVX2 clone but not in
// sym_prob (z·s used twice), so at |Z| ≈ 1e8 the backward's gaps differed from the forward's by an
// ulp (2-8), a factor up to e^8 on P. The forward and backward must see bit-identical gaps.

// max_j (z_j − p)
HNCLIP_CLONES static float seg_max_f32(const float* z, int64_t n, float p) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) {
    const float d = z[j] - p;
    m = d > m ? d : m;
  }
  return m;
}

// Σ e, Σ e·d, Σ d with d = z − p, e = exp(d − m)
HNCLIP_CLONES static void seg_sums_f32(const float* z, int64_t n, float p, float m, float* out) {
  float se = 0.f, sw = 0.f, sd = 0.f;
#pragma omp simd reduction(+ : se, sw, sd)
  for (int64_t j = 0; j < n; ++j) {
    const float d = z[j] - p;
    const float e = exp_f32(d - m);
    se += e;
    sw += e * d;
    sd += d;
  }
  out[0] += se;
  out[1] += sw;
  out[2] += sd;
}

// out ← w · exp((z − p) − shift)   (out may be z)
HNCLIP_CLONES static void seg_prob_f32(const float* z, float* out, int64_t n, float p, float shift, float w) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float d = z[j] - p;
    out[j] = w * exp_f32(d - shift);
  }
}

// float64: the accuracy path (tests, gradcheck), plain loops with std::exp.
static double seg_max(const double* z, int64_t n, double p) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const double d = z[j] - p;
    m = d > m ? d : m;
  }
  return m;
}
static void seg_sums(const double* z, int64_t n, double p, double m, double* out) {
  double se = 0., sw = 0., sd = 0.;
  for (int64_t j = 0; j < n; ++j) {
    const double d = z[j] - p;
    const double e = std::exp(d - m);
    se += e;
    sw += e * d;
    sd += d;
  }
  out[0] += se;
  out[1] += sw;
  out[2] += sd;
}
static void seg_prob(const double* z, double* out, int64_t n, double p, double shift, double w) {
  for (int64_t j = 0; j < n; ++j) out[j] = w * std::exp((z[j] - p) - shift);
}
static inline float seg_max(const float* z, int64_t n, float p) { return seg_max_f32(z, n, p); }
static inline void seg_sums(const float* z, int64_t n, float p, float m, float* out) { seg_sums_f32(z, n, p, m, out); }
static inline void seg_prob(const float* z, float* out, int64_t n, float p, float shift, float w) {
  seg_prob_f32(z, out, n, p, shift, w);
}

// Column-wise loops of the symmetric kernels: vectorised across the columns j of one row
// of a tile, with a per-column positive p_j (d_j = z_j − p_j), so the column statistics
// (the t2i rows of Zᵀ) come from the same row-major tile as the row statistics.
// mx_j ← max(mx_j, d_j)
HNCLIP_CLONES static void col_max_f32(const float* z, const float* p, int64_t n, float* mx) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float d = z[j] - p[j];
    mx[j] = d > mx[j] ? d : mx[j];
  }
}

// se_j += e, sw_j += e·d, sd_j += d with e = exp(d − m_j)
HNCLIP_CLONES static void col_sums_f32(const float* z, const float* p, const float* m, int64_t n, float* se, float* sw,
                                       float* sd) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float d = z[j] - p[j];
    const float e = exp_f32(d - m[j]);
    se[j] += e;
    sw[j] += e * d;
    sd[j] += d;
  }
}

// out_j ← w·exp((z_j − p) − shift) + wc_j·exp((z_j − pc_j) − shc_j): row i's softmax over its
// negatives plus column j's (the transposed direction's) at the same logit (out may be z)
HNCLIP_CLONES static void sym_prob_f32(const float* z, float* out, int64_t n, float p, float shift, float w,
                                       const float* pc, const float* shc, const float* wc) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float zj = z[j];
    out[j] = w * exp_f32((zj - p) - shift) + wc[j] * exp_f32((zj - pc[j]) - shc[j]);
  }
}

static void col_max(const double* z, const double* p, int64_t n, double* mx) {
  for (int64_t j = 0; j < n; ++j) {
    const double d = z[j] - p[j];
    mx[j] = d > mx[j] ? d : mx[j];
  }
}
static void col_sums(const double* z, const double* p, const double* m, int64_t n, double* se, double* sw,
                     double* sd) {
  for (int64_t j = 0; j < n; ++j) {
    const double d = z[j] - p[j];
    const double e = std::exp(d - m[j]);
    se[j] += e;
    sw[j] += e * d;
    sd[j] += d;
  }
}
static void sym_prob(const double* z, double* out, int64_t n, double p, double shift, double w, const double* pc,
                     const double* shc, const double* wc) {
  for (int64_t j = 0; j < n; ++j) {
    const double zj = z[j];
    out[j] = w * std::exp((zj - p) - shift) + wc[j] * std::exp((zj - pc[j]) - shc[j]);
  }
}
static inline void col_max(const float* z, const float* p, int64_t n, float* mx) { col_max_f32(z, p, n, mx); }
static inline void col_sums(const float* z, const float* p, const float* m, int64_t n, float* se, float* sw,
                            float* sd) {
  col_sums_f32(z, p, m, n, se, sw, sd);
}
static inline void sym_prob(const float* z, float* out, int64_t n, float p, float shift, float w, const float* pc,
                            const float* shc, const float* wc) {
  sym_prob_f32(z, out, n, p, shift, w, pc, shc, wc);
}

template <typename T>
static inline T softplus(T x) {  // log(1 + e^x) without overflow; −inf → 0, NaN → NaN
  return x > T(0) ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x));
}

// Online log-sum-exp state of one row: running max, Σe, Σe·d (both relative to m), Σd.
template <typename T>
struct RowState {
  T m = -std::numeric_limits<T>::infinity();
  T acc[3] = {T(0), T(0), T(0)};  // Σe, Σe·d, Σd
};

// Fold the n columns z[0..n) of one row into st, skipping column `excl` (the positive).
template <typename T>
static void update_row(const T* z, int64_t n, int64_t excl, T p, RowState<T>& st) {
  const int64_t n1 = (excl >= 0 && excl < n) ? excl : n;  // [0, n1) and [n1 + 1, n)
  const int64_t n2 = n1 < n ? n - n1 - 1 : 0;
  if (n1 + n2 == 0) return;
  T tmax = -std::numeric_limits<T>::infinity();
  if (n1 > 0) tmax = std::max(tmax, seg_max(z, n1, p));
  if (n2 > 0) tmax = std::max(tmax, seg_max(z + n1 + 1, n2, p));
  const T new_m = std::max(st.m, tmax);
  const T safe = (new_m == -std::numeric_limits<T>::infinity()) ? T(0) : new_m;  // no −inf − −inf
  if (st.m != new_m) {
    const T rescale = std::exp(st.m - safe);
    st.acc[0] *= rescale;
    st.acc[1] *= rescale;
  }
  if (n1 > 0) seg_sums(z, n1, p, safe, st.acc);
  if (n2 > 0) seg_sums(z + n1 + 1, n2, p, safe, st.acc);
  st.m = new_m;
}

template <typename T>
static void finish_row(const RowState<T>& st, T* delta, T* mean_neg, T* dsum) {
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

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------
// The logit tile grid. Every pass over one (L, R) pair, forward or backward, row or column
// statistics, forms its logits tile by tile on the same grid and with the same call:
//   tile (t, c) = query rows [t·tr, t·tr + tr) × key columns [c·bn, c·bn + bn) (clipped),
//   computed by form_tile, one GEMM into a (tr × bn) scratch (leading dimension bn).
// The grid depends on M, N and the machine's core count only, never on at::get_num_threads()
// (which may change between a forward and its backward) or on how a pass groups its rows:
// a BLAS product is not shape-independent (MKL rounds an element of a 1×512, 8×8 or
// strided-output product differently from the same element of a 128×512 one; for small D
// even between ordinary tile shapes), and at |Z| ≈ 1e8 one ulp of a logit (8) is a factor e^8
// on P = exp(Z − LSE). Forming the same tile with the same call makes the backward's logits
// bit-identical to those the forward's statistics came from.
// ---------------------------------------------------------------------------------------
constexpr int64_t kBlockN = 512;     // key columns per tile (float32 128×512: 256 KiB)
constexpr int64_t kTileRows = 128;   // most query rows per tile
constexpr int64_t kMinRows = 16;     // fewest query rows per tile
constexpr int64_t kStripRows = 256;  // rows per strip (several tile-rows) when P is kept (grad)
constexpr int64_t kPartialBudget = int64_t(256) << 20;  // bytes of per-group key accumulators

// Tile-rows a batch is cut into when the rows allow: enough to feed every core (at least 4),
// a constant of the process
inline int64_t grid_tasks() {
  static const int64_t tasks = std::max<int64_t>(4, static_cast<int64_t>(std::thread::hardware_concurrency()));
  return tasks;
}

struct TileGrid {
  int64_t M, N, tr, bn, tiles;  // tiles: tile-rows
  TileGrid(int64_t m, int64_t n)
      : M(m),
        N(n),
        // M / grid_tasks() rows rounded up to a multiple of 16, between 16 and 128
        tr(std::min(kTileRows, std::max(kMinRows, ceil_div(ceil_div(m, grid_tasks()), kMinRows) * kMinRows))),
        bn(std::min(kBlockN, std::max<int64_t>(n, 1))),
        tiles(ceil_div(m, tr)) {}
  int64_t rows_of(int64_t t) const { return std::min(tr, M - t * tr); }
  Tensor scratch(const at::TensorOptions& opts) const { return at::empty({tr, bn}, opts); }
};

// Z of tile rows [i0, i0 + rows) × columns [n0, n0 + nb) into scratch[:rows, :nb]. Callers pass
// tile-aligned i0 / n0 and the tile's full extent: the one place a logit is made.
inline void form_tile(const Tensor& L, const Tensor& R, int64_t i0, int64_t rows, int64_t n0, int64_t nb,
                      Tensor& scratch) {
  Tensor tile = scratch.narrow(0, 0, rows).narrow(1, 0, nb);
  at::mm_out(tile, L.narrow(0, i0, rows), R.narrow(0, n0, nb).t());
}

// Rows [i0, i0 + rows) (whole tile-rows) against every column tile, each tile formed once into
// scratch: row_fn(r, i, n0, nb, z) for each row r of the strip (i = i0 + r), z its nb logits.
template <typename T, typename RowFn>
inline void sweep_strip(const TileGrid& grid, const Tensor& L, const Tensor& R, int64_t i0, int64_t rows,
                        Tensor& scratch, RowFn&& row_fn) {
  const T* sp = scratch.data_ptr<T>();
  for (int64_t r0 = 0; r0 < rows; r0 += grid.tr) {
    const int64_t tr = std::min(grid.tr, rows - r0);
    for (int64_t n0 = 0; n0 < grid.N; n0 += grid.bn) {
      const int64_t nb = std::min(grid.bn, grid.N - n0);
      form_tile(L, R, i0 + r0, tr, n0, nb, scratch);
      for (int64_t r = r0; r < r0 + tr; ++r) row_fn(r, i0 + r, n0, nb, sp + (r - r0) * grid.bn);
    }
  }
}

// Runs body(i0, rows, strip, scratch, part, first_in_group) over strips of whole tile-rows
// (about kStripRows rows each, at least one per group when there are enough tile-rows), split
// into contiguous groups. strip is (>= rows, N), scratch a tile. With `acc`, each group adds
// into its own (N, D) key accumulator (the first group into acc itself) and the groups are
// summed in order at the end, so the result does not depend on how threads were scheduled
// (bit-identical for a fixed thread count); part is null without acc.
template <typename T, typename F>
void grouped_strips(const TileGrid& grid, int64_t D, Tensor* acc, const at::TensorOptions& opts, F&& body) {
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t per_partial = std::max<int64_t>(grid.N * D * static_cast<int64_t>(sizeof(T)), 1);
  const int64_t groups_wanted = acc != nullptr ? std::min(threads, 1 + kPartialBudget / per_partial) : threads;
  const int64_t per_strip =
      std::max<int64_t>(1, std::min(kStripRows / grid.tr, grid.tiles / groups_wanted));  // tile-rows
  const int64_t count = ceil_div(grid.tiles, per_strip);
  const int64_t groups = std::min(groups_wanted, count);
  std::vector<Tensor> partial(acc != nullptr ? groups : 0);
  if (acc != nullptr) {
    partial[0] = *acc;
    for (int64_t g = 1; g < groups; ++g) partial[g] = at::empty({grid.N, D}, opts);
  }
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    Tensor strip = at::empty({per_strip * grid.tr, std::max<int64_t>(grid.N, 1)}, opts);
    Tensor scratch = grid.scratch(opts);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t first = g * count / groups, last = (g + 1) * count / groups;
      for (int64_t s = first; s < last; ++s) {
        const int64_t i0 = s * per_strip * grid.tr;
        body(i0, std::min(per_strip * grid.tr, grid.M - i0), strip, scratch,
             acc != nullptr ? &partial[g] : nullptr, s == first);
      }
    }
  });
  for (int64_t g = 1; g < static_cast<int64_t>(partial.size()); ++g) acc->add_(partial[g]);
}

// ---------------------------------------------------------------------------------------
// Row sweep
// ---------------------------------------------------------------------------------------
template <typename T>
struct RowSweep {
  Tensor L, R;        // (M, Dl), (N, Dl): Z = L Rᵀ (1/τ folded into L)
  Tensor qh, kh;      // (M, D), (N, D)
  const T* pos;       // (M,) Z_i,pos
  int64_t offset;
  // stats outputs (forward) or saved nll (backward recompute)
  T* delta = nullptr;
  T* mean_neg = nullptr;
  T* dsum = nullptr;
  const T* nll_in = nullptr;
  const T* weight = nullptr;  // optional per-row factor of P (the upstream gradient)
  Tensor row_acc, col_acc;    // undefined when not wanted

  void run() {
    const int64_t M = L.size(0), N = R.size(0), D = kh.size(1);
    if (M == 0) {
      if (col_acc.defined()) col_acc.zero_();
      return;
    }
    const TileGrid grid(M, N);
    const auto opts = L.options();
    if (!row_acc.defined() && !col_acc.defined()) {  // statistics only: one tile-row per task, no strip
      at::parallel_for(0, grid.tiles, 1, [&](int64_t t0, int64_t t1) {
        Tensor scratch = grid.scratch(opts);
        for (int64_t t = t0; t < t1; ++t) block(grid, t * grid.tr, grid.rows_of(t), nullptr, scratch, nullptr, true);
      });
      return;
    }
    grouped_strips<T>(grid, D, col_acc.defined() ? &col_acc : nullptr, opts,
                      [&](int64_t i0, int64_t rows, Tensor& strip, Tensor& scratch, Tensor* part, bool first) {
                        block(grid, i0, rows, &strip, scratch, part, first);
                      });
  }

  // rows [i0, i0 + rows) of the queries, whole tile-rows; strip (>= rows, N) or null (statistics only)
  void block(const TileGrid& grid, int64_t i0, int64_t rows, Tensor* strip, Tensor& scratch, Tensor* part,
             bool first_in_group) {
    const int64_t N = grid.N;
    T* bp = strip != nullptr ? strip->data_ptr<T>() : nullptr;  // leading dimension N
    std::vector<RowState<T>> st(delta != nullptr ? rows : 0);
    sweep_strip<T>(grid, L, R, i0, rows, scratch, [&](int64_t r, int64_t i, int64_t n0, int64_t nb, const T* z) {
      if (delta != nullptr) {  // forward: statistics, and the logits kept for P below
        update_row<T>(z, nb, offset + i - n0, pos[i], st[r]);
        if (bp != nullptr) std::memcpy(bp + r * N + n0, z, static_cast<size_t>(nb) * sizeof(T));
      } else {  // backward: P_ik = w_i exp(d_ik − nll_i) straight from the tile
        seg_prob(z, bp + r * N + n0, nb, pos[i], nll_in[i], weight != nullptr ? weight[i] : T(1));
      }
    });
    if (delta != nullptr) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        finish_row<T>(st[r], delta + i, mean_neg + i, dsum + i);
        if (bp != nullptr) {  // P_ik = w_i exp(d_ik − softplus(delta_i))
          T* zr = bp + r * N;
          seg_prob(zr, zr, N, pos[i], softplus<T>(delta[i]), weight != nullptr ? weight[i] : T(1));
        }
      }
    }
    if (bp == nullptr) return;
    for (int64_t r = 0; r < rows; ++r) {  // 0 at the positive
      const int64_t pc = offset + i0 + r;
      if (pc >= 0 && pc < N) bp[r * N + pc] = T(0);
    }
    const Tensor probs = strip->narrow(0, 0, rows);
    if (row_acc.defined()) {
      Tensor out = row_acc.narrow(0, i0, rows);
      at::mm_out(out, probs, kh);
    }
    if (part != nullptr) {
      const Tensor qi = qh.narrow(0, i0, rows);
      if (first_in_group) {
        at::mm_out(*part, probs.t(), qi);
      } else {
        part->addmm_(probs.t(), qi);
      }
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
template <typename T>
struct ColStats {  // online LSE state of every column: max, Σe, Σe·d (relative to max), Σd
  std::vector<T> m, se, sw, sd;
  explicit ColStats(int64_t n)
      : m(n, -std::numeric_limits<T>::infinity()), se(n, T(0)), sw(n, T(0)), sd(n, T(0)) {}
};

// Fold a (rows × nb) tile (leading dimension ld), columns [n0, n0 + nb), into the column
// states; row r's excluded entry (the positive) is at tile column diag + r. scratch: 5·nb.
template <typename T>
void col_update(const T* z, int64_t ld, int64_t rows, int64_t nb, int64_t diag, const T* pc, ColStats<T>& cs,
                int64_t n0, T* scratch) {
  T* tmax = scratch;
  T* safe = scratch + nb;
  T* ts = scratch + 2 * nb;
  T* tw = scratch + 3 * nb;
  T* td = scratch + 4 * nb;
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
    if (n1 > 0) col_max(zr, pc, n1, tmax);
    if (n2 > 0) col_max(zr + n1 + 1, pc + n1 + 1, n2, tmax + n1 + 1);
  }
  T* m = cs.m.data() + n0;
  T* se = cs.se.data() + n0;
  T* sw = cs.sw.data() + n0;
  T* sd = cs.sd.data() + n0;
  for (int64_t j = 0; j < nb; ++j) {
    const T new_m = std::max(m[j], tmax[j]);
    const T sf = (new_m == -std::numeric_limits<T>::infinity()) ? T(0) : new_m;  // no −inf − −inf
    if (m[j] != new_m) {
      const T rescale = std::exp(m[j] - sf);
      se[j] *= rescale;
      sw[j] *= rescale;
    }
    m[j] = new_m;
    safe[j] = sf;
  }
  std::fill(ts, ts + 3 * nb, T(0));  // ts, tw, td: this tile's sums, added to the state once
  for (int64_t r = 0; r < rows; ++r) {
    int64_t n1, n2;
    segments(r, n1, n2);
    const T* zr = z + r * ld;
    if (n1 > 0) col_sums(zr, pc, safe, n1, ts, tw, td);
    if (n2 > 0) col_sums(zr + n1 + 1, pc + n1 + 1, safe + n1 + 1, n2, ts + n1 + 1, tw + n1 + 1, td + n1 + 1);
  }
  for (int64_t j = 0; j < nb; ++j) {
    se[j] += ts[j];
    sw[j] += tw[j];
    sd[j] += td[j];
  }
}

template <typename T>
void symmetric_stats(const Tensor& L, const Tensor& R, const T* pos, T* delta_r, T* mean_r, T* dsum_r, T* delta_c,
                     T* mean_c, T* dsum_c) {
  const int64_t N = R.size(0);
  if (N == 0) return;
  const TileGrid grid(N, N);
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t groups = std::min(threads, grid.tiles);
  const int64_t bn = grid.bn;
  std::vector<ColStats<T>> cols;
  cols.reserve(groups);
  for (int64_t g = 0; g < groups; ++g) cols.emplace_back(N);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    Tensor scratch = grid.scratch(L.options());
    const T* sp = scratch.data_ptr<T>();
    std::vector<T> col_scratch(5 * bn);
    std::vector<RowState<T>> st(grid.tr);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t first = g * grid.tiles / groups, last = (g + 1) * grid.tiles / groups;
      for (int64_t t = first; t < last; ++t) {
        const int64_t i0 = t * grid.tr, rows = grid.rows_of(t);
        std::fill(st.begin(), st.end(), RowState<T>());
        for (int64_t n0 = 0; n0 < N; n0 += bn) {
          const int64_t nb = std::min(bn, N - n0);
          form_tile(L, R, i0, rows, n0, nb, scratch);
          for (int64_t r = 0; r < rows; ++r) update_row<T>(sp + r * bn, nb, i0 + r - n0, pos[i0 + r], st[r]);
          col_update<T>(sp, bn, rows, nb, i0 - n0, pos + n0, cols[g], n0, col_scratch.data());
        }
        for (int64_t r = 0; r < rows; ++r) finish_row<T>(st[r], delta_r + i0 + r, mean_r + i0 + r, dsum_r + i0 + r);
      }
    }
  });
  // merge the groups' column states in group order
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, N, 1024, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      RowState<T> st;
      st.m = cols[0].m[j];
      st.acc[0] = cols[0].se[j];
      st.acc[1] = cols[0].sw[j];
      st.acc[2] = cols[0].sd[j];
      for (int64_t g = 1; g < groups; ++g) {
        const T m2 = cols[g].m[j];
        const T nm = std::max(st.m, m2);
        const T sf = (nm == kNegInf) ? T(0) : nm;
        const T a = (st.m == nm) ? T(1) : std::exp(st.m - sf);
        const T b = (m2 == nm) ? T(1) : std::exp(m2 - sf);
        st.acc[0] = st.acc[0] * a + cols[g].se[j] * b;
        st.acc[1] = st.acc[1] * a + cols[g].sw[j] * b;
        st.acc[2] += cols[g].sd[j];
        st.m = nm;
      }
      finish_row<T>(st, delta_c + j, mean_c + j, dsum_c + j);
    }
  });
}

// Negatives' shares (times τ) of dL/dv̂ and dL/dt̂ for row weights g (both directions'
// upstream gradient of pair k is g_k); nll_r / nll_c = softplus(delta) of i2t / t2i.
template <typename T>
void symmetric_grads(const Tensor& L, const Tensor& R, const Tensor& vh, const T* pos, const T* nll_r, const T* nll_c,
                     const T* g, Tensor& d_v, Tensor& d_t) {
  const int64_t N = R.size(0), D = R.size(1);
  if (N == 0) return;
  const TileGrid grid(N, N);
  grouped_strips<T>(grid, D, &d_t, L.options(),
                    [&](int64_t i0, int64_t rows, Tensor& strip, Tensor& scratch, Tensor* part, bool first) {
    T* bp = strip.data_ptr<T>();
    sweep_strip<T>(grid, L, R, i0, rows, scratch, [&](int64_t r, int64_t i, int64_t n0, int64_t nb, const T* z) {
      sym_prob(z, bp + r * N + n0, nb, pos[i], nll_r[i], g[i], pos + n0, nll_c + n0, g + n0);
    });
    for (int64_t r = 0; r < rows; ++r) bp[r * N + i0 + r] = T(0);
    const Tensor ds = strip.narrow(0, 0, rows);
    Tensor dv = d_v.narrow(0, i0, rows);
    at::mm_out(dv, ds, R);
    const Tensor vi = vh.narrow(0, i0, rows);
    if (first) {
      at::mm_out(*part, ds.t(), vi);
    } else {
      part->addmm_(ds.t(), vi);
    }
  });
}

// ---------------------------------------------------------------------------------------
// Operators
// ---------------------------------------------------------------------------------------
struct Factors {
  Tensor L, R;
};

// Calls f(row, col, value) over rows [r0, r1) of x (any strides, any floating dtype), the
// value converted to T; stops when f returns false.
template <typename T, typename F>
void for_each_as(const Tensor& x, int64_t r0, int64_t r1, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hnclip_read", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1), cols = x.size(1);
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t d = 0; d < cols; ++d)
        if (!f(i, d, static_cast<T>(xp[i * s0 + d * s1]))) return;
  });
}

constexpr int64_t kRowsGrain = 64;

// Is x·inv (row-wise, rounded to T exactly as the Python side's x.to(dt) * inv[:, None])
// bit-identical to ref? Spots the i2t / t2i calls (margin factor = keys / queries) without
// trusting the caller and without a temporary.
template <typename T>
bool scaled_equals(const Tensor& x, const Tensor& inv, const Tensor& ref) {
  if (x.sizes() != ref.sizes()) return false;
  const Tensor ic = inv.to(ref.scalar_type()).contiguous();
  const T* ip = ic.const_data_ptr<T>();
  const T* rp = ref.const_data_ptr<T>();
  const int64_t D = ref.size(1);
  std::atomic<bool> equal{true};
  at::parallel_for(0, ref.size(0), kRowsGrain, [&](int64_t r0, int64_t r1) {
    for_each_as<T>(x, r0, r1, [&](int64_t i, int64_t d, T v) {
      if ((d & 63) == 0 && !equal.load(std::memory_order_relaxed)) return false;
      if ((v * ip[i]) == rp[i * D + d]) return true;
      equal.store(false, std::memory_order_relaxed);
      return false;
    });
  });
  return equal.load();
}

// (base + γ · (x · inv)) · scale as a new contiguous (rows, D) tensor (one pass, no temporaries)
template <typename T>
Tensor add_scaled(const Tensor& base, const Tensor& x, const Tensor& inv, double gamma, T scale) {
  Tensor out = at::empty_like(base, at::MemoryFormat::Contiguous);
  const Tensor ic = inv.to(base.scalar_type()).contiguous();
  const T* ip = ic.const_data_ptr<T>();
  const T* bp = base.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t D = base.size(1);
  const T g = static_cast<T>(gamma);
  at::parallel_for(0, base.size(0), kRowsGrain, [&](int64_t r0, int64_t r1) {
    for_each_as<T>(x, r0, r1, [&](int64_t i, int64_t d, T v) {
      op[i * D + d] = (bp[i * D + d] + g * (v * ip[i])) * scale;
      return true;
    });
  });
  return out;
}

// [base, γ · (x · inv)] · scale as a new contiguous (rows, 2D) tensor
template <typename T>
Tensor cat_scaled(const Tensor& base, const Tensor& x, const Tensor& inv, double gamma, T scale) {
  const int64_t rows = base.size(0), D = base.size(1);
  Tensor out = at::empty({rows, 2 * D}, base.options());
  const Tensor ic = inv.to(base.scalar_type()).contiguous();
  const T* ip = ic.const_data_ptr<T>();
  const T* bp = base.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T g = static_cast<T>(gamma);
  at::parallel_for(0, rows, kRowsGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t d = 0; d < D; ++d) op[i * 2 * D + d] = bp[i * D + d] * scale;
    for_each_as<T>(x, r0, r1, [&](int64_t i, int64_t d, T v) {
      op[i * 2 * D + D + d] = (g * (v * ip[i])) * scale;
      return true;
    });
  });
  return out;
}

// x · scale as a new contiguous tensor (x contiguous in T)
template <typename T>
Tensor times(const Tensor& x, T scale) {
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const T* xp = x.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) op[e] = xp[e] * scale;
  });
  return out;
}

// The two factors of the logits, Z = L Rᵀ, with 1/τ folded into L (so a tile holds Z itself and
// a gap is one subtraction, see the inner loops). qh, kh contiguous in the compute dtype T. The
// forward and the backward build them with the same code from the same inputs: same bits.
template <typename T>
Factors make_factors(const Tensor& qh, const Tensor& kh, const Tensor& a, const Tensor& b, const Tensor& ra,
                     const Tensor& rb, double gamma, T inv_tau) {
  if (gamma == 0.0) return {times<T>(qh, inv_tau), kh};
  if (scaled_equals<T>(b, rb, kh)) return {add_scaled<T>(qh, a, ra, gamma, inv_tau), kh};  // i2t: b̂ = k̂
  if (scaled_equals<T>(a, ra, qh)) return {times<T>(qh, inv_tau), add_scaled<T>(kh, b, rb, gamma, T(1))};  // t2i
  return {cat_scaled<T>(qh, a, ra, gamma, inv_tau), cat_scaled<T>(kh, b, rb, 1.0, T(1))};
}

// A row sweep over the directional logits Z = L Rᵀ of (qh, kh, a, b): the forward and the backward
// recompute build it here, from the same factors, so their tiles agree to the bit.
template <typename T>
RowSweep<T> row_sweep(const Tensor& qh, const Tensor& kh, const Tensor& a, const Tensor& b, const Tensor& ra,
                      const Tensor& rb, const Tensor& pos_c, const Tensor& inv_tau, int64_t offset, double gamma) {
  const Factors f = make_factors<T>(qh, kh, a, b, ra, rb, gamma, inv_tau.to(qh.scalar_type()).item<T>());
  RowSweep<T> sw;
  sw.L = f.L;
  sw.R = f.R;
  sw.qh = qh;
  sw.kh = kh;
  sw.pos = pos_c.data_ptr<T>();
  sw.offset = offset;
  return sw;
}

void check_inputs(const Tensor& qh, const Tensor& kh, const Tensor& a, const Tensor& b, const Tensor& ra,
                  const Tensor& rb, const Tensor& pos, int64_t offset) {
  TORCH_CHECK(qh.dim() == 2 && kh.dim() == 2 && a.dim() == 2 && b.dim() == 2,
              "hnclip: q_hat, k_hat, a, b must be 2-D");
  TORCH_CHECK(qh.device().is_cpu() && kh.device().is_cpu() && a.device().is_cpu() && b.device().is_cpu(),
              "hnclip: the C++ kernel runs on CPU tensors");
  TORCH_CHECK(qh.scalar_type() == at::kFloat || qh.scalar_type() == at::kDouble,
              "hnclip: q_hat must be float32 or float64, got ", qh.scalar_type());
  TORCH_CHECK(kh.scalar_type() == qh.scalar_type(), "hnclip: q_hat and k_hat dtypes differ");
  const int64_t M = qh.size(0), N = kh.size(0), D = qh.size(1);
  TORCH_CHECK(kh.size(1) == D && a.size(1) == D && b.size(1) == D, "hnclip: feature dims differ");
  TORCH_CHECK(a.size(0) == M && b.size(0) == N, "hnclip: a must have M rows and b N rows");
  TORCH_CHECK(ra.numel() == M && rb.numel() == N && pos.numel() == M, "hnclip: norm/positive sizes");
  TORCH_CHECK(offset >= 0 && offset + M <= N, "hnclip: need 0 <= offset and offset + M <= N, got offset ",
              offset, ", M ", M, ", N ", N);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> directional_fwd(
    const Tensor& q_hat, const Tensor& k_hat, const Tensor& a, const Tensor& b, const Tensor& ra,
    const Tensor& rb, const Tensor& pos, const Tensor& inv_tau, int64_t offset, double gamma, bool need_grad) {
  check_inputs(q_hat, k_hat, a, b, ra, rb, pos, offset);
  at::NoGradGuard no_grad;  // kernel scratch only; autograd lives in hnclip_kernels/ops/hn_clip_cpp.py
  const auto dt = q_hat.scalar_type();
  const int64_t M = q_hat.size(0), N = k_hat.size(0), D = q_hat.size(1);
  const auto opts = q_hat.options();
  const Tensor qh = q_hat.contiguous(), kh = k_hat.contiguous();
  const Tensor pos_c = pos.to(dt).contiguous();
  Tensor delta = at::empty({M}, opts), mean_neg = at::empty({M}, opts), dsum = at::empty({M}, opts);
  Tensor row_acc = at::empty({need_grad ? M : 0, D}, opts);
  Tensor col_acc = at::empty({need_grad ? N : 0, D}, opts);
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_directional_fwd", [&] {
    RowSweep<scalar_t> sw = row_sweep<scalar_t>(qh, kh, a, b, ra, rb, pos_c, inv_tau, offset, gamma);
    sw.delta = delta.data_ptr<scalar_t>();
    sw.mean_neg = mean_neg.data_ptr<scalar_t>();
    sw.dsum = dsum.data_ptr<scalar_t>();
    if (need_grad) {
      sw.row_acc = row_acc;
      sw.col_acc = col_acc;
    }
    sw.run();
  });
  return {delta, mean_neg, dsum, row_acc, col_acc};
}

// Negatives' share of dL/dq̂ and dL/dk̂ (times τ) for upstream row gradients g.
std::tuple<Tensor, Tensor> directional_bwd(const Tensor& q_hat, const Tensor& k_hat, const Tensor& a,
                                           const Tensor& b, const Tensor& ra, const Tensor& rb, const Tensor& pos,
                                           const Tensor& inv_tau, const Tensor& delta, const Tensor& row_acc,
                                           const Tensor& col_acc, const Tensor& g, int64_t offset, double gamma) {
  check_inputs(q_hat, k_hat, a, b, ra, rb, pos, offset);
  at::NoGradGuard no_grad;
  const auto dt = q_hat.scalar_type();
  const int64_t M = q_hat.size(0), N = k_hat.size(0), D = q_hat.size(1);
  TORCH_CHECK(delta.numel() == M && g.numel() == M, "hnclip: delta and g need M entries");
  const auto opts = q_hat.options();
  const Tensor gc = g.to(dt).contiguous();
  const bool have_acc = row_acc.dim() == 2 && row_acc.size(0) == M && row_acc.size(1) == D &&
                        col_acc.dim() == 2 && col_acc.size(0) == N && col_acc.size(1) == D;
  Tensor d_q, d_k;
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_directional_bwd", [&] {
    const scalar_t* gp = gc.data_ptr<scalar_t>();
    bool uniform = true;
    for (int64_t i = 1; i < M && uniform; ++i) uniform = gp[i] == gp[0];
    if (have_acc) {
      d_q = row_acc.to(dt).mul(gc.unsqueeze(1));
      if (uniform) d_k = col_acc.to(dt).mul(M > 0 ? at::Scalar(gp[0]) : at::Scalar(0.0));
    }
    if (d_q.defined() && d_k.defined()) return;
    const Tensor qh = q_hat.contiguous(), kh = k_hat.contiguous();
    const Tensor pos_c = pos.to(dt).contiguous();
    Tensor nll = at::empty({M}, opts);
    {
      const Tensor dl = delta.to(dt).contiguous();
      const scalar_t* dp = dl.data_ptr<scalar_t>();
      scalar_t* np = nll.data_ptr<scalar_t>();
      for (int64_t i = 0; i < M; ++i) np[i] = softplus<scalar_t>(dp[i]);
    }
    // one row sweep over the forward's tile grid: the same logits, bit for bit, as the forward's
    // statistics came from; strips of w_i P_ik into the key gradient (per-group accumulators) and,
    // when the forward kept no shares, into the query gradient too
    RowSweep<scalar_t> sw = row_sweep<scalar_t>(qh, kh, a, b, ra, rb, pos_c, inv_tau, offset, gamma);
    sw.nll_in = nll.data_ptr<scalar_t>();
    sw.weight = gp;
    if (!d_q.defined()) {
      d_q = at::empty({M, D}, opts);
      sw.row_acc = d_q;
    }
    d_k = at::empty({N, D}, opts);
    sw.col_acc = d_k;
    sw.run();
  });
  return {d_q, d_k};
}

void check_symmetric(const Tensor& vh, const Tensor& th, const Tensor& pos) {
  TORCH_CHECK(vh.dim() == 2 && th.dim() == 2, "hnclip: v_hat and t_hat must be 2-D");
  TORCH_CHECK(vh.device().is_cpu() && th.device().is_cpu(), "hnclip: the C++ kernel runs on CPU tensors");
  TORCH_CHECK(vh.scalar_type() == at::kFloat || vh.scalar_type() == at::kDouble,
              "hnclip: v_hat must be float32 or float64, got ", vh.scalar_type());
  TORCH_CHECK(th.scalar_type() == vh.scalar_type(), "hnclip: v_hat and t_hat dtypes differ");
  TORCH_CHECK(vh.sizes() == th.sizes(), "hnclip: v_hat and t_hat shapes differ");
  TORCH_CHECK(pos.numel() == vh.size(0), "hnclip: pos needs N entries");
}

// L = (v̂ + γ t̂) / τ: the i2t logits' left factor, margin and temperature included (Z = L t̂ᵀ);
// the forward and the backward build it with this one function from the same inputs: same bits
template <typename T>
Tensor margin_left(const Tensor& vh, const Tensor& th, double gamma, T inv_tau) {
  Tensor out = at::empty_like(vh, at::MemoryFormat::Contiguous);
  const T* vp = vh.const_data_ptr<T>();
  const T* tp = th.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T g = static_cast<T>(gamma);
  at::parallel_for(0, vh.numel(), 1 << 16, [&](int64_t e0, int64_t e1) {
    if (gamma == 0.0) {
      for (int64_t e = e0; e < e1; ++e) op[e] = vp[e] * inv_tau;
    } else {
      for (int64_t e = e0; e < e1; ++e) op[e] = (vp[e] + g * tp[e]) * inv_tau;
    }
  });
  return out;
}

Tensor softplus_of(const Tensor& x, at::ScalarType dt) {
  Tensor out = x.to(dt).contiguous().clone();
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_softplus", [&] {
    scalar_t* p = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < out.numel(); ++i) p[i] = softplus<scalar_t>(p[i]);
  });
  return out;
}

// Row (i2t) and column (t2i) statistics of the single-process loss from one product.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> symmetric_fwd(const Tensor& v_hat, const Tensor& t_hat,
                                                                         const Tensor& pos, const Tensor& inv_tau,
                                                                         double gamma) {
  check_symmetric(v_hat, t_hat, pos);
  at::NoGradGuard no_grad;
  const auto dt = v_hat.scalar_type();
  const int64_t N = v_hat.size(0);
  const auto opts = v_hat.options();
  const Tensor vh = v_hat.contiguous(), th = t_hat.contiguous();
  const Tensor pos_c = pos.to(dt).contiguous();
  Tensor dr = at::empty({N}, opts), mr = at::empty({N}, opts), sr = at::empty({N}, opts);
  Tensor dc = at::empty({N}, opts), mc = at::empty({N}, opts), sc = at::empty({N}, opts);
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_symmetric_fwd", [&] {
    const Tensor L = margin_left<scalar_t>(vh, th, gamma, inv_tau.to(dt).item<scalar_t>());
    symmetric_stats<scalar_t>(L, th, pos_c.data_ptr<scalar_t>(), dr.data_ptr<scalar_t>(), mr.data_ptr<scalar_t>(),
                              sr.data_ptr<scalar_t>(), dc.data_ptr<scalar_t>(), mc.data_ptr<scalar_t>(),
                              sc.data_ptr<scalar_t>());
  });
  return {dr, mr, sr, dc, mc, sc};
}

// Negatives' shares of dL/dv̂ and dL/dt̂ (times τ), both directions, for pair weights g.
std::tuple<Tensor, Tensor> symmetric_bwd(const Tensor& v_hat, const Tensor& t_hat, const Tensor& pos,
                                         const Tensor& inv_tau, const Tensor& delta_r, const Tensor& delta_c,
                                         const Tensor& g, double gamma) {
  check_symmetric(v_hat, t_hat, pos);
  at::NoGradGuard no_grad;
  const auto dt = v_hat.scalar_type();
  const int64_t N = v_hat.size(0), D = v_hat.size(1);
  TORCH_CHECK(delta_r.numel() == N && delta_c.numel() == N && g.numel() == N,
              "hnclip: delta_r, delta_c and g need N entries");
  const auto opts = v_hat.options();
  const Tensor vh = v_hat.contiguous(), th = t_hat.contiguous();
  const Tensor pos_c = pos.to(dt).contiguous(), gc = g.to(dt).contiguous();
  const Tensor nll_r = softplus_of(delta_r, dt), nll_c = softplus_of(delta_c, dt);
  Tensor d_v = at::empty({N, D}, opts), d_t = at::empty({N, D}, opts);
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_symmetric_bwd", [&] {
    const Tensor L = margin_left<scalar_t>(vh, th, gamma, inv_tau.to(dt).item<scalar_t>());
    symmetric_grads<scalar_t>(L, th, vh, pos_c.data_ptr<scalar_t>(), nll_r.data_ptr<scalar_t>(),
                              nll_c.data_ptr<scalar_t>(), gc.data_ptr<scalar_t>(), d_v, d_t);
  });
  return {d_v, d_t};
}

}  // namespace

TORCH_LIBRARY(hnclip, m) {
  m.def(
      "directional_fwd(Tensor q_hat, Tensor k_hat, Tensor a, Tensor b, Tensor ra, Tensor rb, Tensor pos, "
      "Tensor inv_tau, int offset, float gamma, bool need_grad) "
      "-> (Tensor delta, Tensor mean_neg, Tensor dsum, Tensor row_acc, Tensor col_acc)");
  m.def(
      "directional_bwd(Tensor q_hat, Tensor k_hat, Tensor a, Tensor b, Tensor ra, Tensor rb, Tensor pos, "
      "Tensor inv_tau, Tensor delta, Tensor row_acc, Tensor col_acc, Tensor g, int offset, float gamma) "
      "-> (Tensor d_q_neg, Tensor d_k_neg)");
  m.def(
      "symmetric_fwd(Tensor v_hat, Tensor t_hat, Tensor pos, Tensor inv_tau, float gamma) "
      "-> (Tensor delta_r, Tensor mean_neg_r, Tensor dsum_r, Tensor delta_c, Tensor mean_neg_c, Tensor dsum_c)");
  m.def(
      "symmetric_bwd(Tensor v_hat, Tensor t_hat, Tensor pos, Tensor inv_tau, Tensor delta_r, Tensor delta_c, "
      "Tensor g, float gamma) -> (Tensor d_v_neg, Tensor d_t_neg)");
}

TORCH_LIBRARY_IMPL(hnclip, CPU, m) {
  m.impl("directional_fwd", &directional_fwd);
  m.impl("directional_bwd", &directional_bwd);
  m.impl("symmetric_fwd", &symmetric_fwd);
  m.impl("symmetric_bwd", &symmetric_bwd);
}

}  // namespace hnclip

// `import hnclip_kernels._C` loads this library, which runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "hnclip C++ CPU kernels (torch.ops.hnclip)",
                                          -1, nullptr};
  return PyModule_Create(&module_def);
}
