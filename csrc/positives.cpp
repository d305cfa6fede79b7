// The multi-positive targets' pass (group_mode "supcon" / "mil_nce", hnclip_kernels/group_mode.py):
// a row's positives P(i) are its own column offset + i and every column j < K whose group id equals
// the row's. The logit sweeps (sweeps.h) see them as masked columns (the GroupMask drops them from
// the negatives' statistics, as under "mask"), so everything the sweeps compute is over the
// negatives K(i) alone; this pass adds the positives. It cannot read their logits from the tiles:
// a tile holds Z with the margin folded into its factors, and a positive carries no margin. So it
// forms each positive's logit Z_ip = (q̂_i·k̂_p)/τ itself, one row dot per same-group pair (O(|P|·D),
// against the tiles' O(M·N·D); the pairs are found by comparing ids, O(M·N)), with the same
// function in the forward and the backward: the same bits.
//   positive_fwd: per row, the online LSE state (online_lse.h) of the gaps d = Z_ip − Z_i,pos over the
//     row's other positives: their LSE, softmax-weighted mean gap, Σd and count (the negatives' four
//     statistics' layout).
//   positive_bwd: dS of every positive (the row's own included) from the rows' factors
//     (positive_dz in factors.h, the switch on the mode), into dL/dq̂ (rows, in parallel) and dL/dk̂
//     (columns, in parallel: no two tasks write one row), and Σ_p dS·d per row (for dL/dτ).
#include "factors.h"
#include "online_lse.h"
#include "ops.h"

#include <ATen/Dispatch.h>

namespace hnclip {
namespace {

// One side of the same-group pairs of a directional call: q̂ (M, D), k̂ (N, D) contiguous in T, the
// rows' positive logits, 1/τ, the ids qg (M,) and kg (K ≤ N,).
template <typename T>
struct Pairs {
  const T* q;
  const T* k;
  const T* pos;
  T inv_tau;
  const int64_t* qg;
  const int64_t* kg;
  int64_t M, N, K, D, offset;

  bool own(int64_t i, int64_t j) const { return j == offset + i; }
  // another positive of row i: a column with the row's id that is not its own
  bool other(int64_t i, int64_t j) const { return j < K && kg[j] == qg[i] && !own(i, j); }
  // the gap d = Z_ij − Z_i,pos of a same-group pair: its margin-free logit from one row dot
  // (accumulated in double, rounded once)
  T gap(int64_t i, int64_t j) const {
    const T* a = q + i * D;
    const T* b = k + j * D;
    double acc = 0.0;
    for (int64_t d = 0; d < D; ++d) acc += static_cast<double>(a[d]) * static_cast<double>(b[d]);
    return static_cast<T>(acc) * inv_tau - pos[i];
  }
};

template <typename T>
Pairs<T> pairs_of(const Tensor& qh, const Tensor& kh, const Tensor& pos_c, const Tensor& inv_tau, int64_t offset,
                  const Tensor& qg, const Tensor& kg) {
  return Pairs<T>{qh.const_data_ptr<T>(), kh.const_data_ptr<T>(), pos_c.const_data_ptr<T>(),
                  inv_tau.to(qh.scalar_type()).item<T>(), qg.const_data_ptr<int64_t>(), kg.const_data_ptr<int64_t>(),
                  qh.size(0), kh.size(0), kg.numel(), qh.size(1), offset};
}

template <typename T>
PositiveRow<T> row_factors(const T* f, int64_t M, int64_t i, T eps) {
  return PositiveRow<T>{f[i], f[M + i], f[2 * M + i], f[3 * M + i], eps};
}

}  // namespace

Tensor positive_fwd(const Tensor& q_hat, const Tensor& k_hat, const Tensor& pos, const Tensor& inv_tau,
                    int64_t offset, const Tensor& qg, const Tensor& kg) {
  at::NoGradGuard no_grad;
  const auto dt = q_hat.scalar_type();
  const int64_t M = q_hat.size(0);
  const Tensor qh = q_hat.contiguous(), kh = k_hat.contiguous(), pos_c = pos.to(dt).contiguous();
  Tensor out = at::empty({4, M}, q_hat.options());
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_positive_fwd", [&] {
    const Pairs<scalar_t> p = pairs_of<scalar_t>(qh, kh, pos_c, inv_tau, offset, qg, kg);
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        LseState<scalar_t> st;
        for (int64_t j = 0; j < p.K; ++j) {
          if (!p.other(i, j)) continue;
          const scalar_t d = p.gap(i, j);
          const scalar_t safe = lse_rebase(st.m, st.acc[0], st.acc[1], d);
          const scalar_t e = std::exp(d - safe);
          st.acc[0] += e;
          st.acc[1] += e * d;
          st.acc[2] += d;
          st.acc[3] += scalar_t(1);
        }
        finish_row<scalar_t>(st, o + i, o + M + i, o + 2 * M + i);
        o[3 * M + i] = st.acc[3];
      }
    });
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> positive_bwd(const Tensor& q_hat, const Tensor& k_hat, const Tensor& pos,
                                                const Tensor& inv_tau, int64_t offset, const Tensor& qg,
                                                const Tensor& kg, const Tensor& factors, const Tensor& g, double eps,
                                                GroupModeKind kind) {
  at::NoGradGuard no_grad;
  const auto dt = q_hat.scalar_type();
  const int64_t M = q_hat.size(0), N = k_hat.size(0), D = q_hat.size(1);
  const Tensor qh = q_hat.contiguous(), kh = k_hat.contiguous(), pos_c = pos.to(dt).contiguous();
  const Tensor fc = factors.to(dt).contiguous(), gc = g.to(dt).contiguous();
  Tensor d_q = at::zeros({M, D}, q_hat.options()), d_k = at::zeros({N, D}, q_hat.options());
  Tensor dz_d = at::zeros({M}, q_hat.options());
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_positive_bwd", [&] {
    using T = scalar_t;
    const Pairs<T> p = pairs_of<T>(qh, kh, pos_c, inv_tau, offset, qg, kg);
    const T* f = fc.const_data_ptr<T>();
    const T* gp = gc.const_data_ptr<T>();
    const T e = static_cast<T>(eps);
    // dS_ij of row i's positive j (the same expression in both passes: the same bits)
    auto ds = [&](int64_t i, int64_t j, T* d) {
      *d = p.own(i, j) ? T(0) : p.gap(i, j);
      return gp[i] * positive_dz<T>(kind, *d, row_factors<T>(f, M, i, e));
    };
    T* dq = d_q.data_ptr<T>();
    T* dk = d_k.data_ptr<T>();
    T* zd = dz_d.data_ptr<T>();
    at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {  // dL/dq̂_i = Σ_p dS_ip k̂_p
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = 0; j < N; ++j) {
          if (!p.own(i, j) && !p.other(i, j)) continue;
          T d;
          const T s = ds(i, j, &d);
          const T* kj = p.k + j * D;
          for (int64_t c = 0; c < D; ++c) dq[i * D + c] += s * kj[c];
          zd[i] += s * d;
        }
      }
    });
    at::parallel_for(0, N, 16, [&](int64_t j0, int64_t j1) {  // dL/dk̂_j = Σ_i dS_ij q̂_i
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t i = 0; i < M; ++i) {
          if (!p.own(i, j) && !p.other(i, j)) continue;
          T d;
          const T s = ds(i, j, &d);
          const T* qi = p.q + i * D;
          for (int64_t c = 0; c < D; ++c) dk[j * D + c] += s * qi[c];
        }
      }
    });
  });
  return {d_q, d_k, dz_d};
}

}  // namespace hnclip
