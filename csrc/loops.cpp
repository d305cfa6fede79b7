// The float32 inner loops, one target_clones wrapper per loop body of loops.h: GCC builds an
// AVX-512 (x86-64-v4), an AVX2 (x86-64-v3) and a baseline clone of each, the body inlined into
// each, and the loader picks one per machine (the same instruction set for every loop of a
// process). Nothing else goes here: the clones are the only code compiled for more than the
// baseline instruction set (FMA contraction happens only inside them, see the note in loops.h).
#include "loops.h"

namespace hnclip {

HNCLIP_CLONES float seg_max_f32(const float* z, int64_t n, float p) { return seg_max_body<float>(z, n, p); }

HNCLIP_CLONES void seg_sums_f32(const float* z, int64_t n, float p, float m, float* out) {
  seg_sums_body<float>(z, n, p, m, out);
}

HNCLIP_CLONES void seg_prob_f32(const float* z, float* out, int64_t n, float p, float shift, float w) {
  seg_prob_body<float>(z, out, n, p, shift, w);
}

HNCLIP_CLONES void col_max_f32(const float* z, const float* p, int64_t n, float* mx) {
  col_max_body<float>(z, p, n, mx);
}

HNCLIP_CLONES void col_sums_f32(const float* z, const float* p, const float* m, int64_t n, float* se, float* sw,
                                float* sd) {
  col_sums_body<float>(z, p, m, n, se, sw, sd);
}

HNCLIP_CLONES void sym_prob_f32(const float* z, float* out, int64_t n, float p, float shift, float w,
                                const float* pc, const float* shc, const float* wc) {
  sym_prob_body<float>(z, out, n, p, shift, w, pc, shc, wc);
}

HNCLIP_CLONES float seg_max_masked_f32(const float* z, const float* g, int64_t n, float p, float thr) {
  return seg_max_masked_body<float>(z, g, n, p, thr);
}

HNCLIP_CLONES void seg_sums_masked_f32(const float* z, const float* g, int64_t n, float p, float m, float thr,
                                       float* out) {
  seg_sums_masked_body<float>(z, g, n, p, m, thr, out);
}

HNCLIP_CLONES void seg_prob_masked_f32(const float* z, const float* g, float* out, int64_t n, float p, float shift,
                                       float w, float s, float thr) {
  seg_prob_masked_body<float>(z, g, out, n, p, shift, w, s, thr);
}

HNCLIP_CLONES void col_max_masked_f32(const float* z, const float* g, const float* p, int64_t n, float* mx,
                                      float thr) {
  col_max_masked_body<float>(z, g, p, n, mx, thr);
}

HNCLIP_CLONES void col_sums_masked_f32(const float* z, const float* g, const float* p, const float* m, int64_t n,
                                       float* se, float* sw, float* sd, float* sc, float thr) {
  col_sums_masked_body<float>(z, g, p, m, n, se, sw, sd, sc, thr);
}

HNCLIP_CLONES void sym_prob_masked_f32(const float* z, const float* g, float* out, int64_t n, float p, float shift,
                                       float w, float s, const float* pc, const float* shc, const float* wc,
                                       const float* sc, float thr) {
  sym_prob_masked_body<float>(z, g, out, n, p, shift, w, s, pc, shc, wc, sc, thr);
}

}  // namespace hnclip
