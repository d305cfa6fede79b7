// The directional operators: one direction's statistics (and gradient shares) of M query rows
// against N key columns, positive of row i at column offset + i. Inputs checked in registration.cpp.
#include "factors.h"
#include "ops.h"
#include "sweeps.h"

#include <ATen/Dispatch.h>

#include <cmath>
#include <limits>

namespace hnclip {
namespace {

// A row sweep over the directional logits Z = L Rᵀ of (qh, kh, a, b): the forward and the backward
// recompute build it here, from the same factors, so their tiles agree to the bit.
template <typename T, Sweep kMode>
RowSweep<T, kMode> row_sweep(const Tensor& qh, const Tensor& kh, const Tensor& a, const Tensor& b, const Tensor& ra,
                             const Tensor& rb, const Tensor& pos_c, const Tensor& inv_tau, int64_t offset,
                             double gamma) {
  const Factors f = make_factors<T>(qh, kh, a, b, ra, rb, gamma, inv_tau.to(qh.scalar_type()).item<T>());
  RowSweep<T, kMode> sw;
  sw.L = f.L;
  sw.R = f.R;
  sw.qh = qh;
  sw.kh = kh;
  sw.pos = pos_c.data_ptr<T>();
  sw.offset = offset;
  return sw;
}

// False-negative masking on a sweep: the captions' normalised factors (the mask captions ma, mb
// when given, else the margin factors a, b; normalised with the caption norms ca, cb when given,
// else ra, rb) and the threshold; the group ids qg (M,), kg (K,) when given. With ids, a threshold
// of +inf (or none) forms no caption tile. Off (no threshold, no ids): the sweep as it was.
template <typename T, Sweep kMode>
void mask_sweep(RowSweep<T, kMode>& sw, const Tensor& a, const Tensor& b, const Tensor& ra, const Tensor& rb,
                const c10::optional<double>& threshold, const c10::optional<Tensor>& ca,
                const c10::optional<Tensor>& cb, const at::TensorOptions& opts, const Masks& mk) {
  if (!threshold.has_value() && !mk.qg.has_value()) return;
  sw.masked = true;
  const bool ids_alone = mk.qg.has_value() && (!threshold.has_value() || *threshold == std::numeric_limits<double>::infinity());
  const bool cos = threshold.has_value() && !ids_alone;
  if (cos) {
    sw.GL = scaled_rows<T>(mk.ma.has_value() ? *mk.ma : a, ca.has_value() ? *ca : ra, opts);
    sw.GR = scaled_rows<T>(mk.mb.has_value() ? *mk.mb : b, cb.has_value() ? *cb : rb, opts);
  }
  sw.thr = cos ? static_cast<T>(*threshold) : std::numeric_limits<T>::infinity();
  if (mk.qg.has_value()) {
    sw.has_groups = true;
    sw.groups.q = mk.qg->data_ptr<int64_t>();
    sw.groups.k = mk.kg->data_ptr<int64_t>();
    sw.groups.K = mk.kg->numel();
    sw.groups.cos = cos;
  }
}

// The forward's sweep: statistics into (delta, mean_neg, dsum), shares into the accumulators
template <typename T, Sweep kMode>
void forward_sweep(RowSweep<T, kMode> sw, Tensor& delta, Tensor& mean_neg, Tensor& dsum, Tensor& kept,
                   const Tensor& row_acc, const Tensor& col_acc, const c10::optional<Tensor>& prior) {
  if (prior.has_value()) sw.prior = prior->data_ptr<T>();
  sw.delta = delta.data_ptr<T>();
  sw.mean_neg = mean_neg.data_ptr<T>();
  sw.dsum = dsum.data_ptr<T>();
  if (sw.masked) sw.kept = kept.data_ptr<T>();
  if constexpr (kMode == Sweep::kShares) {
    sw.row_acc = row_acc;
    sw.col_acc = col_acc;
  }
  sw.run();
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> directional_fwd(
    const Tensor& q_hat, const Tensor& k_hat, const Tensor& a, const Tensor& b, const Tensor& ra,
    const Tensor& rb, const Tensor& pos, const Tensor& inv_tau, int64_t offset, double gamma, bool need_grad,
    c10::optional<double> threshold, double eps, const c10::optional<Tensor>& ca, const c10::optional<Tensor>& cb,
    const Masks& mk, const c10::optional<Tensor>& prior) {
  at::NoGradGuard no_grad;  // kernel scratch only; autograd lives in hnclip_kernels/backends/cpp/ops.py
  const c10::optional<Tensor> prior_c =
      prior.has_value() ? c10::optional<Tensor>(prior->to(q_hat.scalar_type()).contiguous()) : c10::nullopt;
  const auto dt = q_hat.scalar_type();
  const int64_t M = q_hat.size(0), N = k_hat.size(0), D = q_hat.size(1);
  const auto opts = q_hat.options();
  const Tensor qh = q_hat.contiguous(), kh = k_hat.contiguous();
  const Tensor pos_c = pos.to(dt).contiguous();
  Tensor delta = at::empty({M}, opts), mean_neg = at::empty({M}, opts), dsum = at::empty({M}, opts);
  Tensor kept = at::empty({threshold.has_value() || mk.qg.has_value() ? M : 0}, opts);
  Tensor row_acc = at::empty({need_grad ? M : 0, D}, opts);
  Tensor col_acc = at::empty({need_grad ? N : 0, D}, opts);
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_directional_fwd", [&] {
    if (need_grad) {
      auto sw = row_sweep<scalar_t, Sweep::kShares>(qh, kh, a, b, ra, rb, pos_c, inv_tau, offset, gamma);
      mask_sweep(sw, a, b, ra, rb, threshold, ca, cb, opts, mk);
      sw.eps = static_cast<scalar_t>(eps);
      forward_sweep(sw, delta, mean_neg, dsum, kept, row_acc, col_acc, prior_c);
    } else {
      auto sw = row_sweep<scalar_t, Sweep::kStats>(qh, kh, a, b, ra, rb, pos_c, inv_tau, offset, gamma);
      mask_sweep(sw, a, b, ra, rb, threshold, ca, cb, opts, mk);
      forward_sweep(sw, delta, mean_neg, dsum, kept, row_acc, col_acc, prior_c);
    }
  });
  return {delta, mean_neg, dsum, kept, row_acc, col_acc};
}

// Negatives' share of dL/dq̂ and dL/dk̂ (times τ) for upstream row gradients g.
std::tuple<Tensor, Tensor> directional_bwd(const Tensor& q_hat, const Tensor& k_hat, const Tensor& a,
                                           const Tensor& b, const Tensor& ra, const Tensor& rb, const Tensor& pos,
                                           const Tensor& inv_tau, const Tensor& delta, const Tensor& row_acc,
                                           const Tensor& col_acc, const Tensor& g, int64_t offset, double gamma,
                                           c10::optional<double> threshold, const Tensor& shift,
                                           const c10::optional<Tensor>& ca, const c10::optional<Tensor>& cb,
                                           const Masks& mk) {
  at::NoGradGuard no_grad;
  const auto dt = q_hat.scalar_type();
  const bool masked = threshold.has_value() || mk.qg.has_value();
  const int64_t M = q_hat.size(0), N = k_hat.size(0), D = q_hat.size(1);
  const auto opts = q_hat.options();
  const Tensor gc = g.to(dt).contiguous();
  const bool have_acc = row_acc.dim() == 2 && row_acc.size(0) == M && row_acc.size(1) == D &&
                        col_acc.dim() == 2 && col_acc.size(0) == N && col_acc.size(1) == D;
  Tensor d_q, d_k;
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_directional_bwd", [&] {
    const scalar_t* gp = gc.data_ptr<scalar_t>();
    // each row's (lse, weight): w_i P_ik = e^(d_ik − lse_i)·weight_i (row_factor: rows whose
    // probabilities are float32 subnormals take the softmax over their negatives times g·σ(δ))
    const Tensor shift_c = masked ? shift.to(dt).contiguous() : shift;
    bool shifted = false;
    if (masked) {
      const scalar_t* sp = shift_c.data_ptr<scalar_t>();
      for (int64_t i = 0; i < M && !shifted; ++i) shifted = sp[i] != scalar_t(0);
    }
    Tensor nll = at::empty({M}, opts), weight = at::empty({M}, opts);
    bool deep = false;
    {
      const Tensor dl = delta.to(dt).contiguous();
      const scalar_t* dp = dl.data_ptr<scalar_t>();
      scalar_t* np = nll.data_ptr<scalar_t>();
      scalar_t* wp = weight.data_ptr<scalar_t>();
      for (int64_t i = 0; i < M; ++i) {
        row_factor<scalar_t>(dp[i], gp[i], shifted, np + i, wp + i);
        deep = deep || wp[i] != gp[i] || np[i] != softplus<scalar_t>(dp[i]);
      }
    }
    bool uniform = true;
    for (int64_t i = 1; i < M && uniform; ++i) uniform = gp[i] == gp[0];
    if (have_acc && !deep) {  // the forward's shares, P with weight 1: subnormal on a deep row
      d_q = row_acc.to(dt).mul(gc.unsqueeze(1));
      if (uniform) d_k = col_acc.to(dt).mul(M > 0 ? at::Scalar(gp[0]) : at::Scalar(0.0));
    }
    if (d_q.defined() && d_k.defined()) return;
    const Tensor qh = q_hat.contiguous(), kh = k_hat.contiguous();
    const Tensor pos_c = pos.to(dt).contiguous();
    // one row sweep over the forward's tile grid: the same logits, bit for bit, as the forward's
    // statistics came from; strips of w_i P_ik into the key gradient (per-group accumulators) and,
    // when the forward kept no shares, into the query gradient too
    auto sw = row_sweep<scalar_t, Sweep::kBackward>(qh, kh, a, b, ra, rb, pos_c, inv_tau, offset, gamma);
    mask_sweep(sw, a, b, ra, rb, threshold, ca, cb, opts, mk);
    if (masked) sw.shift = shift_c.data_ptr<scalar_t>();
    sw.nll_in = nll.data_ptr<scalar_t>();
    sw.weight = weight.data_ptr<scalar_t>();
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

}  // namespace hnclip
