// Fused HN-CLIP loss on CPU: the C++ counterpart of hnclip_kernels/backends/triton/.
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
// Files, bottom up:
//   loops.h / loops.cpp  the vectorised inner loops over a tile row (float32 clones per ISA)
//   online_lse.h         the online log-sum-exp state of a row / column and its one merge step
//   tiles.h              the tile grid, form_tile, strips of tile-rows and their groups
//   factors.h            the logits' factors L, R (margin and 1/τ folded in)
//   sweeps.h             the row sweep (RowSweep<T, Sweep mode>) and the symmetric kernels
//   directional.cpp      directional_fwd / directional_bwd
//   symmetric.cpp        symmetric_fwd / symmetric_bwd
//   positives.cpp        positive_fwd / positive_bwd (group_mode's positives, beside either)
//   sigmoid.h            the sigmoid (SigLIP) kind: a pair's softplus loss and its gradient
//   sigmoid_pairs.cpp    sigmoid_fwd / sigmoid_bwd (and the kind's float32 clones)
//   registration.cpp     the argument checks and the torch.ops.hnclip registration
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard in the kernels

#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

#include "factors.h"  // MarginKind, GroupModeKind

namespace hnclip {

// The operators, inputs already checked by registration.cpp (schemas there). False-negative
// masking: ``threshold`` (none: no masking) is the caption cosine â_i·b̂_k at and above which
// column k is no negative of row i, compared in the compute dtype T (the threshold rounded to
// T) with the cosine of the normalised captions' product as BLAS forms it on the tile grid. The
// captions are normalised with ra, rb (directional; symmetric: t_hat as given) unless the
// caption norms ``ca``, ``cb`` (symmetric: ``rc``) are given: the Python side passes them when
// the loss does not normalise (ra, rb are ones then), so the threshold stays a cosine.
// The forwards then also count each row's kept negatives (``kept``, else an empty tensor) and
// with label smoothing ``eps`` put P − ε/n_i into the shares; the backwards take that
// ε/n_i per row (``shift``, per column ``shift_c``) and apply it on the kept entries only.
// The hard-negative family's masking of the directional operators (all absent: today's call).
// ma (M, D), mb (N, D): the captions whose cosine the threshold compares when they are not the
// margin factors a, b (ca, cb are then their inverse norms, required); qg (M,), kg (K ≤ N,)
// int64 group ids: column k < K is no negative of row i when qg[i] == kg[k] (the columns from K
// on carry no id). Either turns the masking on (kept counts, ε over the kept classes) like the
// threshold; with ids a threshold of +inf (or none) is no cosine test. directional_fwd's ``prior``
// (4, M) (optional): the rows' delta, mean_neg, dsum, kept over other columns (the family's
// symmetric tile), merged into the outputs; the shares then hold P over both column sets
// (RowSweep::prior in sweeps.h).
struct Masks {
  c10::optional<at::Tensor> ma, mb, qg, kg;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> directional_fwd(
    const at::Tensor& q_hat, const at::Tensor& k_hat, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& ra, const at::Tensor& rb, const at::Tensor& pos, const at::Tensor& inv_tau, int64_t offset,
    double gamma, bool need_grad, c10::optional<double> threshold, double eps, const c10::optional<at::Tensor>& ca,
    const c10::optional<at::Tensor>& cb, const Masks& mk,
    const c10::optional<at::Tensor>& prior = c10::nullopt);

std::tuple<at::Tensor, at::Tensor> directional_bwd(const at::Tensor& q_hat, const at::Tensor& k_hat,
                                                   const at::Tensor& a, const at::Tensor& b, const at::Tensor& ra,
                                                   const at::Tensor& rb, const at::Tensor& pos,
                                                   const at::Tensor& inv_tau, const at::Tensor& delta,
                                                   const at::Tensor& row_acc, const at::Tensor& col_acc,
                                                   const at::Tensor& g, int64_t offset, double gamma,
                                                   c10::optional<double> threshold, const at::Tensor& shift,
                                                   const c10::optional<at::Tensor>& ca,
                                                   const c10::optional<at::Tensor>& cb, const Masks& mk);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
symmetric_fwd(const at::Tensor& v_hat, const at::Tensor& t_hat, const at::Tensor& pos, const at::Tensor& inv_tau,
              double gamma, c10::optional<double> threshold, const c10::optional<at::Tensor>& rc,
              const c10::optional<at::Tensor>& groups, MarginKind margin);

std::tuple<at::Tensor, at::Tensor> symmetric_bwd(const at::Tensor& v_hat, const at::Tensor& t_hat,
                                                 const at::Tensor& pos, const at::Tensor& inv_tau,
                                                 const at::Tensor& delta_r, const at::Tensor& delta_c,
                                                 const at::Tensor& g, double gamma, c10::optional<double> threshold,
                                                 const at::Tensor& shift_r, const at::Tensor& shift_c,
                                                 const c10::optional<at::Tensor>& rc,
                                                 const c10::optional<at::Tensor>& groups, MarginKind margin);

// The multi-positive targets' pass (positives.cpp; group_mode "supcon" / "mil_nce"): q̂ (M, D) against
// k̂ (N, D), row i's own positive at column offset + i with logit pos[i], its other positives the
// columns j < K with kg[j] == qg[i] (qg (M,), kg (K ≤ N,) int64). positive_fwd: (4, M) over the other
// positives, as the negatives' statistics: LSE of the gaps d = Z_ij − pos_i, softmax-weighted mean
// gap, Σd, count. positive_bwd: the positives' shares (times τ) of dL/dq̂ (M, D) and dL/dk̂ (N, D) for
// row gradients g (M,), each dS = g·positive_dz (factors.h) with the rows' ``factors`` (4, M):
// lse_p, neg_mass, count, shift (PositiveRow), and Σ_p dS·d per row (M,).
at::Tensor positive_fwd(const at::Tensor& q_hat, const at::Tensor& k_hat, const at::Tensor& pos,
                        const at::Tensor& inv_tau, int64_t offset, const at::Tensor& qg, const at::Tensor& kg);

std::tuple<at::Tensor, at::Tensor, at::Tensor> positive_bwd(const at::Tensor& q_hat, const at::Tensor& k_hat,
                                                            const at::Tensor& pos, const at::Tensor& inv_tau,
                                                            int64_t offset, const at::Tensor& qg,
                                                            const at::Tensor& kg, const at::Tensor& factors,
                                                            const at::Tensor& g, double eps, GroupModeKind kind);

// The sigmoid (SigLIP) operators' arguments besides the features (sigmoid_pairs.cpp): s and b
// (0-dim), row i's positive at caption offset + i of the first ``captions`` columns (the rest:
// negatives), γ and the margin's kind; group ids qg (R,), kg (captions,) int64 (absent: none),
// same-group caption columns positives with ``groups_positive``, else masked.
struct SigmoidArgs {
  at::Tensor scale, bias;
  int64_t offset = 0, captions = 0;
  double gamma = 0.0;
  MarginKind margin = MarginKind::kText;
  c10::optional<at::Tensor> qg, kg;
  bool groups_positive = false;
};

// Per-row Σ softplus(−y z), Σ dz·S and Σ dz (dz = σ(z) − [y = 1], S = z − b), each (R,)
std::tuple<at::Tensor, at::Tensor, at::Tensor> sigmoid_fwd(const at::Tensor& v_hat, const at::Tensor& k_hat,
                                                           const at::Tensor& pos, const SigmoidArgs& a);

// dL/dv̂ (R, D) and dL/dk̂ (N, D) for upstream row gradients g (R,)
std::tuple<at::Tensor, at::Tensor> sigmoid_bwd(const at::Tensor& v_hat, const at::Tensor& k_hat,
                                               const at::Tensor& pos, const at::Tensor& g, const SigmoidArgs& a);

}  // namespace hnclip
