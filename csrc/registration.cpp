// torch.ops.hnclip.cpp_raw_*: the raw kernels' operator schemas (no autograd: hnclip_kernels/backends/cpp/ops.py
// wraps them in the hnclip::cpp_* operators), the argument checks, and the CPU registration. The
// Python side (hnclip_kernels/backends/cpp/ops.py) calls these names and schemas; the kernels
// behind them (directional.cpp, symmetric.cpp, positives.cpp, sigmoid_pairs.cpp) assume the checks below have passed.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace hnclip {
namespace {

using at::Tensor;

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
  // offset == N: no column is a positive (the family's negative columns, every one a negative)
  TORCH_CHECK(offset >= 0 && (offset + M <= N || offset == N),
              "hnclip: need 0 <= offset and offset + M <= N (or offset == N), got offset ",
              offset, ", M ", M, ", N ", N);
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

// The caption norms of the masking (optional): one per caption row, as the margin's norms
void check_caption_norms(const c10::optional<Tensor>& ca, const c10::optional<Tensor>& cb, const Tensor& a,
                         const Tensor& b) {
  TORCH_CHECK(!ca.has_value() || ca->numel() == a.size(0), "hnclip: ca needs one entry per row of a");
  TORCH_CHECK(!cb.has_value() || cb->numel() == b.size(0), "hnclip: cb needs one entry per row of b");
}

// The family's masking inputs (optional): mask captions (M, D) and (N, D) with their norms,
// int64 group ids (M,) and (K ≤ N,), passed in pairs; made contiguous
Masks check_masks(const c10::optional<Tensor>& ma, const c10::optional<Tensor>& mb, const c10::optional<Tensor>& qg,
                  const c10::optional<Tensor>& kg, const c10::optional<Tensor>& ca, const c10::optional<Tensor>& cb,
                  const Tensor& a, const Tensor& b) {
  TORCH_CHECK(ma.has_value() == mb.has_value(), "hnclip: ma and mb are passed together");
  TORCH_CHECK(qg.has_value() == kg.has_value(), "hnclip: qg and kg are passed together");
  Masks mk;
  if (ma.has_value()) {
    TORCH_CHECK(ca.has_value() && cb.has_value(), "hnclip: ma and mb need their norms ca and cb");
    TORCH_CHECK(ma->dim() == 2 && mb->dim() == 2 && ma->sizes() == a.sizes() && mb->sizes() == b.sizes(),
                "hnclip: ma must be (M, D) and mb (N, D)");
    TORCH_CHECK(ma->device().is_cpu() && mb->device().is_cpu(), "hnclip: ma and mb must be CPU tensors");
    mk.ma = ma;
    mk.mb = mb;
  }
  if (qg.has_value()) {
    TORCH_CHECK(qg->scalar_type() == at::kLong && kg->scalar_type() == at::kLong, "hnclip: qg and kg must be int64");
    TORCH_CHECK(qg->device().is_cpu() && kg->device().is_cpu(), "hnclip: qg and kg must be CPU tensors");
    TORCH_CHECK(qg->dim() == 1 && kg->dim() == 1 && qg->numel() == a.size(0) && kg->numel() <= b.size(0),
                "hnclip: qg must be (M,) and kg (K,) with K <= N");
    mk.qg = qg->contiguous();
    mk.kg = kg->contiguous();
  }
  return mk;
}

// The symmetric kernels' group ids (optional): int64 (N,) on the CPU, made contiguous
c10::optional<Tensor> check_groups(const c10::optional<Tensor>& groups, const Tensor& vh) {
  if (!groups.has_value()) return groups;
  TORCH_CHECK(groups->scalar_type() == at::kLong && groups->device().is_cpu() && groups->dim() == 1 &&
                  groups->numel() == vh.size(0),
              "hnclip: groups must be an int64 CPU tensor of N entries");
  return groups->contiguous();
}

// The margin's kind from its code (hnclip_kernels.margin.Margin.code): the one range check
MarginKind check_margin(int64_t code) {
  TORCH_CHECK(code >= 0 && code < kMarginKinds, "hnclip: unknown margin code ", code,
              " (Margin.code: 0 text, 1 image_text)");
  return static_cast<MarginKind>(code);
}

// The group mode from its code (hnclip_kernels.group_mode.GroupMode.code): the one range check; the
// positives' kernels take the positive modes only
GroupModeKind check_positive_mode(int64_t code) {
  TORCH_CHECK(code >= 0 && code < kGroupModes, "hnclip: unknown group mode code ", code,
              " (GroupMode.code: 0 mask, 1 supcon, 2 mil_nce)");
  TORCH_CHECK(code != static_cast<int64_t>(GroupModeKind::kMask),
              "hnclip: the positives' kernels take group mode 1 (supcon) or 2 (mil_nce), got 0 (mask)");
  return static_cast<GroupModeKind>(code);
}

// The positives' kernels' arguments: q̂ (M, D), k̂ (N, D) float32/float64 CPU, own positives offset + i < N,
// ids int64 (M,) and (K ≤ N,)
void check_positives(const Tensor& qh, const Tensor& kh, const Tensor& pos, int64_t offset, const Tensor& qg,
                     const Tensor& kg) {
  TORCH_CHECK(qh.dim() == 2 && kh.dim() == 2 && qh.size(1) == kh.size(1), "hnclip: q_hat, k_hat must be 2-D, same D");
  TORCH_CHECK(qh.device().is_cpu() && kh.device().is_cpu() && pos.device().is_cpu() && qg.device().is_cpu() &&
                  kg.device().is_cpu(),
              "hnclip: the C++ kernel runs on CPU tensors");
  TORCH_CHECK(qh.scalar_type() == at::kFloat || qh.scalar_type() == at::kDouble,
              "hnclip: q_hat must be float32 or float64, got ", qh.scalar_type());
  TORCH_CHECK(kh.scalar_type() == qh.scalar_type(), "hnclip: q_hat and k_hat dtypes differ");
  const int64_t M = qh.size(0), N = kh.size(0);
  TORCH_CHECK(pos.numel() == M, "hnclip: pos needs M entries");
  TORCH_CHECK(offset >= 0 && offset + M <= N, "hnclip: need 0 <= offset, offset + M <= N, got offset ", offset,
              ", M ", M, ", N ", N);
  TORCH_CHECK(qg.scalar_type() == at::kLong && kg.scalar_type() == at::kLong && qg.dim() == 1 && kg.dim() == 1 &&
                  qg.numel() == M && kg.numel() <= N,
              "hnclip: qg must be int64 (M,) and kg int64 (K,) with K <= N");
}

Tensor positive_fwd_op(const Tensor& q_hat, const Tensor& k_hat, const Tensor& pos, const Tensor& inv_tau,
                       int64_t offset, const Tensor& qg, const Tensor& kg) {
  check_positives(q_hat, k_hat, pos, offset, qg, kg);
  return positive_fwd(q_hat, k_hat, pos, inv_tau, offset, qg.contiguous(), kg.contiguous());
}

std::tuple<Tensor, Tensor, Tensor> positive_bwd_op(const Tensor& q_hat, const Tensor& k_hat, const Tensor& pos,
                                                   const Tensor& inv_tau, int64_t offset, const Tensor& qg,
                                                   const Tensor& kg, const Tensor& factors, const Tensor& g,
                                                   double eps, int64_t group_mode) {
  check_positives(q_hat, k_hat, pos, offset, qg, kg);
  const GroupModeKind kind = check_positive_mode(group_mode);
  const int64_t M = q_hat.size(0);
  TORCH_CHECK(factors.dim() == 2 && factors.size(0) == 4 && factors.size(1) == M && factors.device().is_cpu(),
              "hnclip: factors must be a (4, M) CPU tensor");
  TORCH_CHECK(g.numel() == M && g.device().is_cpu(), "hnclip: g needs M entries");
  return positive_bwd(q_hat, k_hat, pos, inv_tau, offset, qg.contiguous(), kg.contiguous(), factors, g, eps, kind);
}

// The sigmoid operators' arguments: features (R, D), (N, D) float32/float64 CPU, positives
// offset + i inside the first ``captions`` columns, s and b 0-dim, group ids in pairs (int64 (R,),
// (captions,)), the margin's code range-checked
SigmoidArgs check_sigmoid(const Tensor& vh, const Tensor& kh, const Tensor& pos, const Tensor& scale,
                          const Tensor& bias, int64_t offset, int64_t captions, double gamma, int64_t margin,
                          const c10::optional<Tensor>& qg, const c10::optional<Tensor>& kg, bool groups_positive) {
  TORCH_CHECK(vh.dim() == 2 && kh.dim() == 2, "hnclip: v_hat and k_hat must be 2-D");
  TORCH_CHECK(vh.device().is_cpu() && kh.device().is_cpu() && pos.device().is_cpu(),
              "hnclip: the C++ kernel runs on CPU tensors");
  TORCH_CHECK(vh.scalar_type() == at::kFloat || vh.scalar_type() == at::kDouble,
              "hnclip: v_hat must be float32 or float64, got ", vh.scalar_type());
  TORCH_CHECK(kh.scalar_type() == vh.scalar_type(), "hnclip: v_hat and k_hat dtypes differ");
  TORCH_CHECK(kh.size(1) == vh.size(1), "hnclip: feature dims differ");
  const int64_t R = vh.size(0);
  TORCH_CHECK(pos.numel() == R, "hnclip: pos needs R entries");
  TORCH_CHECK(scale.numel() == 1 && bias.numel() == 1, "hnclip: scale and bias must hold one number each");
  TORCH_CHECK(offset >= 0 && offset + R <= captions && captions <= kh.size(0),
              "hnclip: need 0 <= offset, offset + R <= captions <= N, got offset ", offset, ", R ", R, ", captions ",
              captions, ", N ", kh.size(0));
  TORCH_CHECK(qg.has_value() == kg.has_value(), "hnclip: qg and kg are passed together");
  SigmoidArgs a;
  if (qg.has_value()) {
    TORCH_CHECK(qg->scalar_type() == at::kLong && kg->scalar_type() == at::kLong, "hnclip: qg and kg must be int64");
    TORCH_CHECK(qg->device().is_cpu() && kg->device().is_cpu(), "hnclip: qg and kg must be CPU tensors");
    TORCH_CHECK(qg->dim() == 1 && kg->dim() == 1 && qg->numel() == R && kg->numel() == captions,
                "hnclip: qg must be (R,) and kg (captions,)");
    a.qg = qg->contiguous();
    a.kg = kg->contiguous();
  }
  a.scale = scale.reshape({});
  a.bias = bias.reshape({});
  a.offset = offset;
  a.captions = captions;
  a.gamma = gamma;
  a.margin = check_margin(margin);
  a.groups_positive = groups_positive;
  return a;
}

std::tuple<Tensor, Tensor, Tensor> sigmoid_fwd_op(const Tensor& v_hat, const Tensor& k_hat, const Tensor& pos,
                                                  const Tensor& scale, const Tensor& bias, int64_t offset,
                                                  int64_t captions, double gamma, int64_t margin,
                                                  const c10::optional<Tensor>& qg, const c10::optional<Tensor>& kg,
                                                  bool groups_positive) {
  const SigmoidArgs a =
      check_sigmoid(v_hat, k_hat, pos, scale, bias, offset, captions, gamma, margin, qg, kg, groups_positive);
  return sigmoid_fwd(v_hat, k_hat, pos, a);
}

std::tuple<Tensor, Tensor> sigmoid_bwd_op(const Tensor& v_hat, const Tensor& k_hat, const Tensor& pos,
                                          const Tensor& scale, const Tensor& bias, const Tensor& g, int64_t offset,
                                          int64_t captions, double gamma, int64_t margin,
                                          const c10::optional<Tensor>& qg, const c10::optional<Tensor>& kg,
                                          bool groups_positive) {
  const SigmoidArgs a =
      check_sigmoid(v_hat, k_hat, pos, scale, bias, offset, captions, gamma, margin, qg, kg, groups_positive);
  TORCH_CHECK(g.numel() == v_hat.size(0), "hnclip: g needs R entries");
  return sigmoid_bwd(v_hat, k_hat, pos, g, a);
}

// The registered entry points: check, then run the kernel.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> directional_fwd_op(
    const Tensor& q_hat, const Tensor& k_hat, const Tensor& a, const Tensor& b, const Tensor& ra,
    const Tensor& rb, const Tensor& pos, const Tensor& inv_tau, int64_t offset, double gamma, bool need_grad,
    c10::optional<double> threshold, double eps, const c10::optional<Tensor>& ca, const c10::optional<Tensor>& cb,
    const c10::optional<Tensor>& ma, const c10::optional<Tensor>& mb, const c10::optional<Tensor>& qg,
    const c10::optional<Tensor>& kg, const c10::optional<Tensor>& prior) {
  check_inputs(q_hat, k_hat, a, b, ra, rb, pos, offset);
  check_caption_norms(ca, cb, a, b);
  const Masks mk = check_masks(ma, mb, qg, kg, ca, cb, a, b);
  TORCH_CHECK(!prior.has_value() || (prior->dim() == 2 && prior->size(0) == 4 && prior->size(1) == q_hat.size(0) &&
                                     prior->device().is_cpu()),
              "hnclip: prior must be a (4, M) CPU tensor");
  return directional_fwd(q_hat, k_hat, a, b, ra, rb, pos, inv_tau, offset, gamma, need_grad, threshold, eps, ca,
                         cb, mk, prior);
}

std::tuple<Tensor, Tensor> directional_bwd_op(const Tensor& q_hat, const Tensor& k_hat, const Tensor& a,
                                              const Tensor& b, const Tensor& ra, const Tensor& rb, const Tensor& pos,
                                              const Tensor& inv_tau, const Tensor& delta, const Tensor& row_acc,
                                              const Tensor& col_acc, const Tensor& g, int64_t offset, double gamma,
                                              c10::optional<double> threshold, const Tensor& shift,
                                              const c10::optional<Tensor>& ca, const c10::optional<Tensor>& cb,
                                              const c10::optional<Tensor>& ma, const c10::optional<Tensor>& mb,
                                              const c10::optional<Tensor>& qg, const c10::optional<Tensor>& kg) {
  check_inputs(q_hat, k_hat, a, b, ra, rb, pos, offset);
  check_caption_norms(ca, cb, a, b);
  const Masks mk = check_masks(ma, mb, qg, kg, ca, cb, a, b);
  const int64_t M = q_hat.size(0);
  TORCH_CHECK(delta.numel() == M && g.numel() == M, "hnclip: delta and g need M entries");
  TORCH_CHECK(!(threshold.has_value() || qg.has_value()) || shift.numel() == M,
              "hnclip: shift needs M entries with a threshold or group ids");
  return directional_bwd(q_hat, k_hat, a, b, ra, rb, pos, inv_tau, delta, row_acc, col_acc, g, offset, gamma,
                         threshold, shift, ca, cb, mk);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> symmetric_fwd_op(
    const Tensor& v_hat, const Tensor& t_hat, const Tensor& pos, const Tensor& inv_tau, double gamma,
    c10::optional<double> threshold, const c10::optional<Tensor>& rc, const c10::optional<Tensor>& groups,
    int64_t margin) {
  check_symmetric(v_hat, t_hat, pos);
  check_caption_norms(rc, rc, t_hat, t_hat);
  TORCH_CHECK(!groups.has_value() || threshold.has_value(), "hnclip: groups need a threshold (+inf: ids alone)");
  return symmetric_fwd(v_hat, t_hat, pos, inv_tau, gamma, threshold, rc, check_groups(groups, v_hat),
                       check_margin(margin));
}

std::tuple<Tensor, Tensor> symmetric_bwd_op(const Tensor& v_hat, const Tensor& t_hat, const Tensor& pos,
                                            const Tensor& inv_tau, const Tensor& delta_r, const Tensor& delta_c,
                                            const Tensor& g, double gamma, c10::optional<double> threshold,
                                            const Tensor& shift_r, const Tensor& shift_c,
                                            const c10::optional<Tensor>& rc, const c10::optional<Tensor>& groups,
                                            int64_t margin) {
  check_symmetric(v_hat, t_hat, pos);
  TORCH_CHECK(!groups.has_value() || threshold.has_value(), "hnclip: groups need a threshold (+inf: ids alone)");
  check_caption_norms(rc, rc, t_hat, t_hat);
  const int64_t N = v_hat.size(0);
  TORCH_CHECK(delta_r.numel() == N && delta_c.numel() == N && g.numel() == N,
              "hnclip: delta_r, delta_c and g need N entries");
  TORCH_CHECK(!threshold.has_value() || (shift_r.numel() == N && shift_c.numel() == N),
              "hnclip: shift_r and shift_c need N entries with a threshold");
  return symmetric_bwd(v_hat, t_hat, pos, inv_tau, delta_r, delta_c, g, gamma, threshold, shift_r, shift_c, rc,
                       check_groups(groups, v_hat), check_margin(margin));
}

}  // namespace

TORCH_LIBRARY(hnclip, m) {
  m.def(
      "cpp_raw_directional_fwd(Tensor q_hat, Tensor k_hat, Tensor a, Tensor b, Tensor ra, Tensor rb, Tensor pos, "
      "Tensor inv_tau, int offset, float gamma, bool need_grad, float? threshold, float eps, Tensor? ca=None, "
      "Tensor? cb=None, Tensor? ma=None, Tensor? mb=None, Tensor? qg=None, Tensor? kg=None, Tensor? prior=None) "
      "-> (Tensor delta, Tensor mean_neg, Tensor dsum, Tensor kept, Tensor row_acc, Tensor col_acc)");
  m.def(
      "cpp_raw_directional_bwd(Tensor q_hat, Tensor k_hat, Tensor a, Tensor b, Tensor ra, Tensor rb, Tensor pos, "
      "Tensor inv_tau, Tensor delta, Tensor row_acc, Tensor col_acc, Tensor g, int offset, float gamma, "
      "float? threshold, Tensor shift, Tensor? ca=None, Tensor? cb=None, Tensor? ma=None, Tensor? mb=None, "
      "Tensor? qg=None, Tensor? kg=None) -> (Tensor d_q_neg, Tensor d_k_neg)");
  m.def(
      "cpp_raw_symmetric_fwd(Tensor v_hat, Tensor t_hat, Tensor pos, Tensor inv_tau, float gamma, float? threshold, "
      "Tensor? rc=None, Tensor? groups=None, int margin=0) "
      "-> (Tensor delta_r, Tensor mean_neg_r, Tensor dsum_r, Tensor kept_r, Tensor delta_c, Tensor mean_neg_c, "
      "Tensor dsum_c, Tensor kept_c)");
  m.def(
      "cpp_raw_symmetric_bwd(Tensor v_hat, Tensor t_hat, Tensor pos, Tensor inv_tau, Tensor delta_r, Tensor delta_c, "
      "Tensor g, float gamma, float? threshold, Tensor shift_r, Tensor shift_c, Tensor? rc=None, Tensor? groups=None, "
      "int margin=0) "
      "-> (Tensor d_v_neg, Tensor d_t_neg)");
  m.def(
      "cpp_raw_positive_fwd(Tensor q_hat, Tensor k_hat, Tensor pos, Tensor inv_tau, int offset, Tensor qg, Tensor kg) "
      "-> Tensor stats");
  m.def(
      "cpp_raw_positive_bwd(Tensor q_hat, Tensor k_hat, Tensor pos, Tensor inv_tau, int offset, Tensor qg, Tensor kg, "
      "Tensor factors, Tensor g, float eps, int group_mode) -> (Tensor d_q_pos, Tensor d_k_pos, Tensor dz_d)");
  m.def(
      "cpp_raw_sigmoid_fwd(Tensor v_hat, Tensor k_hat, Tensor pos, Tensor scale, Tensor bias, int offset, "
      "int captions, float gamma, int margin, Tensor? qg=None, Tensor? kg=None, bool groups_positive=False) "
      "-> (Tensor loss, Tensor ds_rows, Tensor db_rows)");
  m.def(
      "cpp_raw_sigmoid_bwd(Tensor v_hat, Tensor k_hat, Tensor pos, Tensor scale, Tensor bias, Tensor g, int offset, "
      "int captions, float gamma, int margin, Tensor? qg=None, Tensor? kg=None, bool groups_positive=False) "
      "-> (Tensor d_v, Tensor d_k)");
}

TORCH_LIBRARY_IMPL(hnclip, CPU, m) {
  m.impl("cpp_raw_directional_fwd", &directional_fwd_op);
  m.impl("cpp_raw_directional_bwd", &directional_bwd_op);
  m.impl("cpp_raw_symmetric_fwd", &symmetric_fwd_op);
  m.impl("cpp_raw_symmetric_bwd", &symmetric_bwd_op);
  m.impl("cpp_raw_positive_fwd", &positive_fwd_op);
  m.impl("cpp_raw_positive_bwd", &positive_bwd_op);
  m.impl("cpp_raw_sigmoid_fwd", &sigmoid_fwd_op);
  m.impl("cpp_raw_sigmoid_bwd", &sigmoid_bwd_op);
}

}  // namespace hnclip

// `import hnclip_kernels._C` loads this library, which runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "hnclip C++ CPU kernels (torch.ops.hnclip)",
                                          -1, nullptr};
  return PyModule_Create(&module_def);
}
