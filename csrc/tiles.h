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
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

namespace hnclip {

using at::Tensor;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

// Group-id masking of a directional sweep (the hard-negative family's group_ids): row i's id
// q[i] (M,), column j's id k[j] for j < K (the columns from K on carry none). It writes +inf,
// at or above any threshold, into the caption tile where the ids agree, so the loops of loops.h
// drop those entries exactly as the threshold does (one predicate, keep()). Without a cosine
// test (cos false: ids alone, threshold +inf) the tile is not formed but set to 0 (kept).
struct GroupMask {
  const int64_t* q = nullptr;
  const int64_t* k = nullptr;
  int64_t K = 0;
  bool cos = true;

  // the caption tile g (rows × nb, leading dimension ld) of rows [i0, i0 + rows), columns [n0, n0 + nb)
  template <typename T>
  void apply(int64_t i0, int64_t rows, int64_t n0, int64_t nb, int64_t ld, T* g) const {
    const int64_t j1 = std::min(n0 + nb, K);
    for (int64_t r = 0; r < rows; ++r) {
      T* gr = g + r * ld;
      if (!cos) std::fill(gr, gr + nb, T(0));
      const int64_t id = q[i0 + r];
      for (int64_t j = n0; j < j1; ++j)
        if (k[j] == id) gr[j - n0] = std::numeric_limits<T>::infinity();
    }
  }
};

// Rows [i0, i0 + rows) (whole tile-rows) against every column tile, each tile formed once into
// scratch: row_fn(r, i, n0, nb, z, g) for each row r of the strip (i = i0 + r), z its nb logits.
// With false-negative masking (kMasked) each logit tile's caption-cosine tile G = GL GRᵀ (the
// normalised captions' product) is formed beside it on the same grid and g is its row; without,
// GL and GR are not read and g is z (see loops.h). groups (masked sweeps only; null: none, the
// caption tile as formed) adds the group-id masking to each caption tile.
template <typename T, bool kMasked, typename RowFn>
inline void sweep_strip(const TileGrid& grid, const Tensor& L, const Tensor& R, const Tensor& GL, const Tensor& GR,
                        int64_t i0, int64_t rows, Tensor& scratch, RowFn&& row_fn, const GroupMask* groups = nullptr) {
  Tensor gscratch = kMasked ? grid.scratch(scratch.options()) : scratch;
  const T* sp = scratch.data_ptr<T>();
  const T* gp = gscratch.data_ptr<T>();
  for (int64_t r0 = 0; r0 < rows; r0 += grid.tr) {
    const int64_t tr = std::min(grid.tr, rows - r0);
    for (int64_t n0 = 0; n0 < grid.N; n0 += grid.bn) {
      const int64_t nb = std::min(grid.bn, grid.N - n0);
      form_tile(L, R, i0 + r0, tr, n0, nb, scratch);
      if constexpr (kMasked) {
        if (groups == nullptr || groups->cos) form_tile(GL, GR, i0 + r0, tr, n0, nb, gscratch);
        if (groups != nullptr) groups->apply<T>(i0 + r0, tr, n0, nb, grid.bn, gscratch.data_ptr<T>());
      }
      for (int64_t r = r0; r < r0 + tr; ++r) {
        row_fn(r, i0 + r, n0, nb, sp + (r - r0) * grid.bn, gp + (r - r0) * grid.bn);
      }
    }
  }
}

// Runs body(i0, rows, strip, scratch, part, first_in_group) over strips of whole tile-rows
// (about kStripRows rows each, at least one per group when there are enough tile-rows), split
// into contiguous groups. strip is (>= rows, N), scratch a tile. Each group adds into its own
// (N, D) key accumulator `part` (the first group into acc itself) and the groups are summed in
// order at the end, so the result does not depend on how threads were scheduled (bit-identical
// for a fixed thread count).
template <typename T, typename F>
void grouped_strips(const TileGrid& grid, int64_t D, Tensor& acc, const at::TensorOptions& opts, F&& body) {
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t per_partial = std::max<int64_t>(grid.N * D * static_cast<int64_t>(sizeof(T)), 1);
  const int64_t groups_wanted = std::min(threads, 1 + kPartialBudget / per_partial);
  const int64_t per_strip =
      std::max<int64_t>(1, std::min(kStripRows / grid.tr, grid.tiles / groups_wanted));  // tile-rows
  const int64_t count = ceil_div(grid.tiles, per_strip);
  const int64_t groups = std::min(groups_wanted, count);
  std::vector<Tensor> partial(groups);
  partial[0] = acc;
  for (int64_t g = 1; g < groups; ++g) partial[g] = at::empty({grid.N, D}, opts);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    Tensor strip = at::empty({per_strip * grid.tr, std::max<int64_t>(grid.N, 1)}, opts);
    Tensor scratch = grid.scratch(opts);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t first = g * count / groups, last = (g + 1) * count / groups;
      for (int64_t s = first; s < last; ++s) {
        const int64_t i0 = s * per_strip * grid.tr;
        body(i0, std::min(per_strip * grid.tr, grid.M - i0), strip, scratch, partial[g], s == first);
      }
    }
  });
  for (int64_t g = 1; g < groups; ++g) acc.add_(partial[g]);
}

}  // namespace hnclip
