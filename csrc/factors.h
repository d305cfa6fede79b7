// The two factors of the logits, Z = L Rᵀ, built from the inputs in one pass each, with the
// margin and 1/τ folded in: the left factor carries 1/τ so a tile holds Z itself and a gap is one
// subtraction (see loops.h). The forward and the backward build them with these functions from
// the same inputs, so their tiles agree to the bit.
//   directional: make_factors (the i2t / t2i shortcut below spares the (inner dim 2D) product)
//   symmetric:   margin_left, L = (v̂ + γ m̂)/τ against R = t̂, m̂ the margin's rows (margin_rows)
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstdint>

namespace hnclip {

using at::Tensor;

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

// x · inv (row-wise) as a new contiguous (rows, D) tensor of T: the normalised margin factor â or b̂,
// rounded as the Python side's x.to(dt) * inv[:, None] (the captions' cosines of the masking)
template <typename T>
Tensor scaled_rows(const Tensor& x, const Tensor& inv, const at::TensorOptions& opts) {
  const int64_t rows = x.size(0), D = x.size(1);
  Tensor out = at::empty({rows, D}, opts);
  const Tensor ic = inv.to(opts.dtype()).contiguous();
  const T* ip = ic.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, kRowsGrain, [&](int64_t r0, int64_t r1) {
    for_each_as<T>(x, r0, r1, [&](int64_t i, int64_t d, T v) {
      op[i * D + d] = v * ip[i];
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
// a gap is one subtraction, see loops.h). qh, kh contiguous in the compute dtype T. The
// forward and the backward build them with the same code from the same inputs: same bits.
template <typename T>
Factors make_factors(const Tensor& qh, const Tensor& kh, const Tensor& a, const Tensor& b, const Tensor& ra,
                     const Tensor& rb, double gamma, T inv_tau) {
  if (gamma == 0.0) return {times<T>(qh, inv_tau), kh};
  if (scaled_equals<T>(b, rb, kh)) return {add_scaled<T>(qh, a, ra, gamma, inv_tau), kh};  // i2t: b̂ = k̂
  if (scaled_equals<T>(a, ra, qh)) return {times<T>(qh, inv_tau), add_scaled<T>(kh, b, rb, gamma, T(1))};  // t2i
  return {cat_scaled<T>(qh, a, ra, gamma, inv_tau), cat_scaled<T>(kh, b, rb, 1.0, T(1))};
}

// The margin's kind, as hnclip_kernels.margin.Margin.code (registration.cpp range-checks the code once)
enum class MarginKind : int64_t { kText = 0, kImageText = 1 };
constexpr int64_t kMarginKinds = 2;

// The symmetric margin's factor rows m̂ (the margin γ·sg(m̂_i·t̂_k); L = (v̂ + γ m̂)/τ): the one switch on
// the margin's kind. kText: the captions t̂ (HN-CLIP's sg(t̂_i·t̂_k)); kImageText: the images v̂ (the
// detached logit sg(v̂_i·t̂_k): the same tile, no extra product)
inline const Tensor& margin_rows(MarginKind kind, const Tensor& vh, const Tensor& th) {
  switch (kind) {
    case MarginKind::kText:
      return th;
    case MarginKind::kImageText:
      return vh;
  }
  TORCH_CHECK(false, "hnclip: unknown margin kind ", static_cast<int64_t>(kind));
}

// What equal group ids mean, as hnclip_kernels.group_mode.GroupMode.code (registration.cpp range-checks
// the code once): kMask drops same-group pairs from the softmax (the sweeps' GroupMask); kSupcon and
// kMilNce make them positives (positives.cpp), whose dS is the one switch below
enum class GroupModeKind : int64_t { kMask = 0, kSupcon = 1, kMilNce = 2 };
constexpr int64_t kGroupModes = 3;

// A row's factors for its positives' dS (hnclip_kernels.backends.softmax.positive_factors), relative to
// the row's own positive Z_i,pos: lse_p = LSE over its positives P(i), neg_mass = σ(L_K − L_P) (its
// negatives' share of the softmax mass), count = |P(i)|, shift = ε/|C(i)| (C(i) = P(i) ∪ K(i)), eps = ε
template <typename T>
struct PositiveRow {
  T lse_p, neg_mass, count, shift, eps;
};

// dL/dZ_ip / g_i of row i's positive p at gap d = Z_ip − Z_i,pos (the row's own positive: d = 0): the
// softmax p_ip less the mode's target (1 − ε)·w_ip and the smoothing share ε/|C(i)|; the one switch on
// the group mode. With u = softmax_P(Z_i)_p = e^(d − lse_p), p_ip = u·(1 − neg_mass), so neither mode
// subtracts the nearly equal p_ip and its target on a saturated row (neg_mass → 0):
//   kSupcon (w = 1/|P|):  (u − 1/|P|) − u·neg_mass + (ε/|P| − ε/|C|)   (u − 1/|P| exactly 0 for |P| = 1)
//   kMilNce (w = u):      u·(ε − neg_mass) − ε/|C|
template <typename T>
inline T positive_dz(GroupModeKind kind, T d, const PositiveRow<T>& r) {
  const T u = std::exp(d - r.lse_p);
  switch (kind) {
    case GroupModeKind::kSupcon:
      return (u - T(1) / r.count) - u * r.neg_mass + (r.eps / r.count - r.shift);
    case GroupModeKind::kMilNce:
      return u * (r.eps - r.neg_mass) - r.shift;
    case GroupModeKind::kMask:
      break;
  }
  TORCH_CHECK(false, "hnclip: group mode ", static_cast<int64_t>(kind), " has no positives");
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

}  // namespace hnclip
