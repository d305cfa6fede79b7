// The symmetric (single-process) operators: N images against N texts, positives on the diagonal,
// both directions from one logit tile (see sweeps.h). Inputs checked in registration.cpp.
#include "factors.h"
#include "ops.h"
#include "sweeps.h"

#include <ATen/Dispatch.h>

#include <limits>

namespace hnclip {
namespace {

// The family's group ids (N,) as a symmetric GroupMask: every column carries an id; a threshold of
// +inf (ids alone) forms no caption tile. Unused (and empty) without ids.
GroupMask group_mask(const c10::optional<Tensor>& groups, const c10::optional<double>& threshold) {
  GroupMask gm;
  if (!groups.has_value()) return gm;
  gm.q = groups->data_ptr<int64_t>();
  gm.k = gm.q;
  gm.K = groups->numel();
  gm.cos = !(threshold.has_value() && *threshold == std::numeric_limits<double>::infinity());
  return gm;
}

}  // namespace

// Row (i2t) and column (t2i) statistics of the single-process loss from one product. The family's
// inputs: group ids (N,) int64 (pairs with equal ids masked in both directions) and the margin's kind
// (its factor rows, margin_rows in factors.h: kImageText's L = (v̂ + γ v̂)/τ, the same tile, no extra product).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> symmetric_fwd(
    const Tensor& v_hat, const Tensor& t_hat, const Tensor& pos, const Tensor& inv_tau, double gamma,
    c10::optional<double> threshold, const c10::optional<Tensor>& rc, const c10::optional<Tensor>& groups,
    MarginKind margin) {
  at::NoGradGuard no_grad;
  const auto dt = v_hat.scalar_type();
  const int64_t N = v_hat.size(0);
  const auto opts = v_hat.options();
  const Tensor vh = v_hat.contiguous(), th = t_hat.contiguous();
  const Tensor pos_c = pos.to(dt).contiguous();
  Tensor dr = at::empty({N}, opts), mr = at::empty({N}, opts), sr = at::empty({N}, opts);
  Tensor dc = at::empty({N}, opts), mc = at::empty({N}, opts), sc = at::empty({N}, opts);
  const int64_t K = threshold.has_value() ? N : 0;
  Tensor kr = at::empty({K}, opts), kc = at::empty({K}, opts);
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_symmetric_fwd", [&] {
    const Tensor L = margin_left<scalar_t>(vh, margin_rows(margin, vh, th), gamma, inv_tau.to(dt).item<scalar_t>());
    SymMask<scalar_t> mask{static_cast<scalar_t>(threshold.value_or(0.0)), kr.data_ptr<scalar_t>(),
                           kc.data_ptr<scalar_t>()};
    if (threshold.has_value() && rc.has_value()) mask.captions = scaled_rows<scalar_t>(th, *rc, opts);
    const GroupMask gm = group_mask(groups, threshold);
    if (groups.has_value()) mask.groups = &gm;
    symmetric_stats<scalar_t>(L, th, pos_c.data_ptr<scalar_t>(), dr.data_ptr<scalar_t>(), mr.data_ptr<scalar_t>(),
                              sr.data_ptr<scalar_t>(), dc.data_ptr<scalar_t>(), mc.data_ptr<scalar_t>(),
                              sc.data_ptr<scalar_t>(), threshold.has_value() ? &mask : nullptr);
  });
  return {dr, mr, sr, kr, dc, mc, sc, kc};
}

// Negatives' shares of dL/dv̂ and dL/dt̂ (times τ), both directions, for pair weights g.
std::tuple<Tensor, Tensor> symmetric_bwd(const Tensor& v_hat, const Tensor& t_hat, const Tensor& pos,
                                         const Tensor& inv_tau, const Tensor& delta_r, const Tensor& delta_c,
                                         const Tensor& g, double gamma, c10::optional<double> threshold,
                                         const Tensor& shift_r, const Tensor& shift_c,
                                         const c10::optional<Tensor>& rc, const c10::optional<Tensor>& groups,
                                         MarginKind margin) {
  at::NoGradGuard no_grad;
  const auto dt = v_hat.scalar_type();
  const int64_t N = v_hat.size(0), D = v_hat.size(1);
  const auto opts = v_hat.options();
  const Tensor vh = v_hat.contiguous(), th = t_hat.contiguous();
  const Tensor pos_c = pos.to(dt).contiguous(), gc = g.to(dt).contiguous();
  Tensor d_v = at::empty({N, D}, opts), d_t = at::empty({N, D}, opts);
  AT_DISPATCH_FLOATING_TYPES(dt, "hnclip_symmetric_bwd", [&] {
    // each direction's (lse, weight) per row (row_factor); label-smoothing shifts keep (softplus δ, g)
    bool shifted = false;
    if (threshold.has_value()) {
      const Tensor sr = shift_r.to(dt).contiguous(), sc = shift_c.to(dt).contiguous();
      const scalar_t *a = sr.data_ptr<scalar_t>(), *b = sc.data_ptr<scalar_t>();
      for (int64_t i = 0; i < N && !shifted; ++i) shifted = a[i] != scalar_t(0) || b[i] != scalar_t(0);
    }
    Tensor nll_r = at::empty({N}, opts), nll_c = at::empty({N}, opts);
    Tensor w_r = at::empty({N}, opts), w_c = at::empty({N}, opts);
    {
      const Tensor dr = delta_r.to(dt).contiguous(), dc = delta_c.to(dt).contiguous();
      const scalar_t *drp = dr.data_ptr<scalar_t>(), *dcp = dc.data_ptr<scalar_t>(), *gp = gc.data_ptr<scalar_t>();
      for (int64_t i = 0; i < N; ++i) {
        row_factor<scalar_t>(drp[i], gp[i], shifted, nll_r.data_ptr<scalar_t>() + i, w_r.data_ptr<scalar_t>() + i);
        row_factor<scalar_t>(dcp[i], gp[i], shifted, nll_c.data_ptr<scalar_t>() + i, w_c.data_ptr<scalar_t>() + i);
      }
    }
    const Tensor L = margin_left<scalar_t>(vh, margin_rows(margin, vh, th), gamma, inv_tau.to(dt).item<scalar_t>());
    SymMask<scalar_t> mask{static_cast<scalar_t>(threshold.value_or(0.0))};
    Tensor s_r, s_c;
    if (threshold.has_value()) {
      s_r = shift_r.to(dt).contiguous();
      s_c = shift_c.to(dt).contiguous();
      mask.s_r = s_r.data_ptr<scalar_t>();
      mask.s_c = s_c.data_ptr<scalar_t>();
      if (rc.has_value()) mask.captions = scaled_rows<scalar_t>(th, *rc, opts);
    }
    const GroupMask gm = group_mask(groups, threshold);
    if (groups.has_value()) mask.groups = &gm;
    symmetric_grads<scalar_t>(L, th, vh, pos_c.data_ptr<scalar_t>(), nll_r.data_ptr<scalar_t>(),
                              nll_c.data_ptr<scalar_t>(), w_r.data_ptr<scalar_t>(), w_c.data_ptr<scalar_t>(), d_v, d_t,
                              threshold.has_value() ? &mask : nullptr);
  });
  return {d_v, d_t};
}

}  // namespace hnclip
