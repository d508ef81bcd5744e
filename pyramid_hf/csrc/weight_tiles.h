// Shared by the few-row linear kernels (skinny_linear.cpp, skinny_linear_bf16.cpp): how threads split the work.
//
// Threads split the N output features into tiles of NB weight rows; each tile is walked by rows(nb, n0), where nb is
// std::integral_constant<int, NB> for a full tile and <int, 1> for each row of the short last one, so the kernels
// compile one register-tile shape per case. A kernel's rows callback must compute y[:, n0 .. n0 + nb) alone.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pyramid_hf {

template <int NB, typename RowsFn>
void for_each_weight_tile(int64_t N, RowsFn&& rows) {
  const int64_t tiles = (N + NB - 1) / NB;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const int64_t n0 = t * NB;
      if (N - n0 >= NB) {
        rows(std::integral_constant<int, NB>{}, n0);
      } else {
        for (int64_t n = n0; n < N; n++) rows(std::integral_constant<int, 1>{}, n);
      }
    }
  });
}

}  // namespace pyramid_hf
