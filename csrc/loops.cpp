// The float32 inner loops, one target_clones wrapper per loop body of loops.h, instantiated
// without and with false-negative masking (kMasked): GCC builds an AVX-512 (x86-64-v4), an AVX2
// (x86-64-v3) and a baseline clone of each, the body inlined into each, and the loader picks one
// per machine (the same instruction set for every loop of a process). Nothing else goes here:
// the clones are the only code compiled for more than the baseline instruction set (FMA
// contraction happens only inside them, see the note in loops.h).
#include "loops.h"

namespace hnclip {

template <bool kMasked>
HNCLIP_CLONES float seg_max_f32(const float* z, const float* g, int64_t n, float p, float thr) {
  return seg_max_body<float, kMasked>(z, g, n, p, thr);
}

template <bool kMasked>
HNCLIP_CLONES void seg_sums_f32(const float* z, const float* g, int64_t n, float p, float m, float thr, float* out) {
  seg_sums_body<float, kMasked>(z, g, n, p, m, thr, out);
}

template <bool kMasked>
HNCLIP_CLONES void seg_prob_f32(const float* z, const float* g, float* out, int64_t n, float p, float shift,
                                float w, float s, float thr) {
  seg_prob_body<float, kMasked>(z, g, out, n, p, shift, w, s, thr);
}

template <bool kMasked>
HNCLIP_CLONES void col_max_f32(const float* z, const float* g, const float* p, int64_t n, float* mx, float thr) {
  col_max_body<float, kMasked>(z, g, p, n, mx, thr);
}

template <bool kMasked>
HNCLIP_CLONES void col_sums_f32(const float* z, const float* g, const float* p, const float* m, int64_t n,
                                float* se, float* sw, float* sd, float* sc, float thr) {
  col_sums_body<float, kMasked>(z, g, p, m, n, se, sw, sd, sc, thr);
}

template <bool kMasked>
HNCLIP_CLONES void sym_prob_f32(const float* z, const float* g, float* out, int64_t n, float p, float shift,
                                float w, float s, const float* pc, const float* shc, const float* wc,
                                const float* sc, float thr) {
  sym_prob_body<float, kMasked>(z, g, out, n, p, shift, w, s, pc, shc, wc, sc, thr);
}

// Both instantiations of each (the kernels' translation units see the declarations only)
#define HNCLIP_INSTANTIATE(kMasked)                                                                              \
  template float seg_max_f32<kMasked>(const float*, const float*, int64_t, float, float);                        \
  template void seg_sums_f32<kMasked>(const float*, const float*, int64_t, float, float, float, float*);         \
  template void seg_prob_f32<kMasked>(const float*, const float*, float*, int64_t, float, float, float, float,   \
                                      float);                                                                    \
  template void col_max_f32<kMasked>(const float*, const float*, const float*, int64_t, float*, float);          \
  template void col_sums_f32<kMasked>(const float*, const float*, const float*, const float*, int64_t, float*,   \
                                      float*, float*, float*, float);                                            \
  template void sym_prob_f32<kMasked>(const float*, const float*, float*, int64_t, float, float, float, float,   \
                                      const float*, const float*, const float*, const float*, float);
HNCLIP_INSTANTIATE(false)
HNCLIP_INSTANTIATE(true)
#undef HNCLIP_INSTANTIATE

}  // namespace hnclip
