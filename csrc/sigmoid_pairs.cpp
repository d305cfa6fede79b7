// The sigmoid (SigLIP) operators: R image rows against the columns k̂ = [captions (C); negatives (M)],
// row i's positive at caption offset + i. The kind's pair loss and gradient are in sigmoid.h;
// this file sweeps the tiles (tiles.h: the grid, form_tile, sweep_strip, grouped_strips, the same
// machinery as the InfoNCE sweeps) and holds the kind's float32 clones. Inputs checked in
// registration.cpp.
//
// The logit tile holds S = s·w with s folded into the left factor, so z = S + b is one addition:
//   L = s·(v̂ + γ m̂)   (m̂ = margin_rows: kText the row's own caption k̂_{offset+i}, kImageText v̂),
// the margin's γ·sg(h) folded in as InfoNCE folds it. A positive has no margin: the diagonal's
// score is pos (host), and with group ids as positives and γ ≠ 0 a second, margin-free tile
// U = (s·v̂)·k̂ᵀ is formed beside each logit tile (sweep_strip's second factor pair).
//   forward  (one product; two with group positives under a margin): per row Σ softplus(x),
//            Σ dz·S and Σ dz (dL/ds·s and dL/db for g = 1; the host weighs them with g), no N×N.
//   backward (three products; four): the strip's tiles recomputed on the same grid, dS = g·s·dz,
//            dv̂ = dS·K̂ and dK̂ = dSᵀ·V̂ (per-group key accumulators, summed in group order).
#include "factors.h"
#include "ops.h"
#include "sigmoid.h"
#include "tiles.h"

#include <ATen/Dispatch.h>

#include <vector>

namespace hnclip {

// ---- float32 clones of the kind's loops (as loops.cpp's: AVX-512, AVX2, baseline)
HNCLIP_CLONES void sigmoid_sums_f32(const float* S, const float* y, int64_t n, float b, float* out) {
  sigmoid_sums_body<float>(S, y, n, b, out);
}

HNCLIP_CLONES void sigmoid_ds_f32(const float* S, const float* y, int64_t n, float b, float w, float* out) {
  sigmoid_ds_body<float>(S, y, n, b, w, out);
}

namespace {

// The tiles' factors and labels of one call; the forward and the backward build it with this one
// function from the same inputs, so their tiles agree to the bit.
template <typename T>
struct SigmoidSweep {
  Tensor L, U, K, V;  // L, U (undefined: no margin-free tile needed) against K = k̂; V = v̂
  SigmoidLabels<T> labels;
  T b = T(0);

  SigmoidSweep(const Tensor& vh, const Tensor& kh, const Tensor& pos, const SigmoidArgs& a) : K(kh), V(vh) {
    const T s = a.scale.to(vh.scalar_type()).item<T>();
    b = a.bias.to(vh.scalar_type()).item<T>();
    const int64_t R = vh.size(0);
    L = margin_left<T>(vh, margin_rows(a.margin, vh, kh.narrow(0, a.offset, R)), a.gamma, s);
    if (a.qg.has_value() && a.groups_positive && a.gamma != 0.0) U = margin_left<T>(vh, vh, 0.0, s);
    labels.pos = pos.data_ptr<T>();
    labels.offset = a.offset;
    labels.C = a.captions;
    if (a.qg.has_value()) {
      labels.qg = a.qg->data_ptr<int64_t>();
      labels.kg = a.kg->data_ptr<int64_t>();
      labels.positive = a.groups_positive;
    }
  }

  // row_fn(r, i, n0, nb, S, y) over rows [i0, i0 + rows) against every column tile, S and y the
  // segment's scores and labels (SigmoidLabels::row)
  template <typename RowFn>
  void strip(const TileGrid& grid, int64_t i0, int64_t rows, Tensor& scratch, RowFn&& row_fn) const {
    std::vector<T> buf(2 * grid.bn);
    T* S = buf.data();
    T* y = S + grid.bn;
    auto each = [&](int64_t r, int64_t i, int64_t n0, int64_t nb, const T* z, const T* u) {
      labels.row(i, n0, nb, z, u, S, y);
      row_fn(r, i, n0, nb, S, y);
    };
    if (U.defined()) {
      sweep_strip<T, true>(grid, L, K, U, K, i0, rows, scratch, each);  // u: the margin-free tile
    } else {
      sweep_strip<T, false>(grid, L, K, L, K, i0, rows, scratch, each);  // u = z (L margin-free then)
    }
  }
};

}  // namespace

std::tuple<Tensor, Tensor, Tensor> sigmoid_fwd(const Tensor& v_hat, const Tensor& k_hat, const Tensor& pos,
                                               const SigmoidArgs& a) {
  at::NoGradGuard no_grad;
  const auto dt = v_hat.scalar_type();
  const int64_t R = v_hat.size(0);
  const auto opts = v_hat.options();
  const Tensor vh = v_hat.contiguous(), kh = k_hat.contiguous(), pos_c = pos.to(dt).contiguous();
  Tensor loss = at::zeros({R}, opts), ds = at::zeros({R}, opts), db = at::zeros({R}, opts);
  if (R == 0) return {loss, ds, db};
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_sigmoid_fwd", [&] {
    const SigmoidSweep<scalar_t> sw(vh, kh, pos_c, a);
    const TileGrid grid(R, kh.size(0));
    scalar_t* lp = loss.data_ptr<scalar_t>();
    scalar_t* sp = ds.data_ptr<scalar_t>();
    scalar_t* bp = db.data_ptr<scalar_t>();
    at::parallel_for(0, grid.tiles, 1, [&](int64_t t0, int64_t t1) {  // one tile-row per task
      Tensor scratch = grid.scratch(opts);
      std::vector<scalar_t> acc(3 * grid.tr);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i0 = t * grid.tr, rows = grid.rows_of(t);
        std::fill(acc.begin(), acc.end(), scalar_t(0));
        sw.strip(grid, i0, rows, scratch,
                 [&](int64_t r, int64_t, int64_t, int64_t nb, const scalar_t* S, const scalar_t* y) {
          sigmoid_sums<scalar_t>(S, y, nb, sw.b, acc.data() + 3 * r);
        });
        for (int64_t r = 0; r < rows; ++r) {
          lp[i0 + r] = acc[3 * r];
          sp[i0 + r] = acc[3 * r + 1];
          bp[i0 + r] = acc[3 * r + 2];
        }
      }
    });
  });
  return {loss, ds, db};
}

std::tuple<Tensor, Tensor> sigmoid_bwd(const Tensor& v_hat, const Tensor& k_hat, const Tensor& pos, const Tensor& g,
                                       const SigmoidArgs& a) {
  at::NoGradGuard no_grad;
  const auto dt = v_hat.scalar_type();
  const int64_t R = v_hat.size(0), N = k_hat.size(0), D = v_hat.size(1);
  const auto opts = v_hat.options();
  const Tensor vh = v_hat.contiguous(), kh = k_hat.contiguous(), pos_c = pos.to(dt).contiguous();
  Tensor d_v = at::empty({R, D}, opts), d_k = at::empty({N, D}, opts);
  if (R == 0) return {d_v, d_k.zero_()};
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_sigmoid_bwd", [&] {
    const SigmoidSweep<scalar_t> sw(vh, kh, pos_c, a);
    const TileGrid grid(R, N);
    const Tensor w = (g.to(dt) * a.scale.to(dt)).contiguous();  // g_i·s: s folded into dS
    const scalar_t* wp = w.data_ptr<scalar_t>();
    grouped_strips<scalar_t>(grid, D, d_k, opts,
                             [&](int64_t i0, int64_t rows, Tensor& strip, Tensor& scratch, Tensor& part, bool first) {
      scalar_t* bp = strip.data_ptr<scalar_t>();  // leading dimension N
      sw.strip(grid, i0, rows, scratch,
               [&](int64_t r, int64_t i, int64_t n0, int64_t nb, const scalar_t* S, const scalar_t* y) {
        sigmoid_ds<scalar_t>(S, y, nb, sw.b, wp[i], bp + r * N + n0);
      });
      const Tensor dS = strip.narrow(0, 0, rows);
      Tensor dv = d_v.narrow(0, i0, rows);
      at::mm_out(dv, dS, kh);
      const Tensor vi = vh.narrow(0, i0, rows);
      if (first) {
        at::mm_out(part, dS.t(), vi);
      } else {
        part.addmm_(dS.t(), vi);
      }
    });
  });
  return {d_v, d_k};
}

}  // namespace hnclip
