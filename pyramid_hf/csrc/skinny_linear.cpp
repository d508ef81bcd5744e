// A float32 linear for calls of few rows (speculative decoding's verification and drafting calls) on AVX2 CPUs.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]). Threads split the output features; each walks a block of NB weight
// rows once from memory and reuses it, from cache, for every MB-row group of x, with NB x MB accumulators in
// registers. Library GEMMs (MKL, oneDNN) are tuned for wide calls: at 4 to 16 rows they run 1.3-2x slower than this
// on a 2-core AVX2 EPYC, where a few-row call should cost about what reading the weights once costs.
//
// Each (m, n) has a single accumulator walked over k in the same order whatever the number of rows, so a row's result
// does not depend on how many rows share the call (tests/test_cpu_kernels.py checks this bit for bit).
#include <torch/extension.h>
#include <immintrin.h>

#include "weight_tiles.h"

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[0..mrows) x [n0, n0 + nrows) for x rows starting at x (row stride K), weight rows starting at w (row stride K).
template <int NB, int MB>
void tile(const float* x, const float* w, int64_t K, float* y, int64_t N, const float* bias, int64_t n0,
          int mrows, int nrows) {
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; i++)
    for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MB];
    for (int j = 0; j < MB; j++) xv[j] = _mm256_loadu_ps(x + j * K + k);
    for (int i = 0; i < NB; i++) {
      const __m256 wv = _mm256_loadu_ps(w + i * K + k);
      for (int j = 0; j < MB; j++) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < nrows; i++) {
    for (int j = 0; j < mrows; j++) {
      float s = horizontal_sum(acc[i][j]);
      for (int64_t k = K8; k < K; k++) s += x[j * K + k] * w[i * K + k];
      if (bias != nullptr) s += bias[n0 + i];
      y[j * N + n0 + i] = s;
    }
  }
}

constexpr int kRowsPerTile = 4;   // NB: weight rows walked together
constexpr int kInputsPerTile = 3; // MB: x rows per register tile (4 x 3 accumulators + 3 inputs + 1 weight = 16 ymm)

template <int NB>
void weight_rows(const float* x, const float* w, int64_t M, int64_t K, float* y, int64_t N, const float* bias,
                 int64_t n0, int nrows) {
  for (int64_t m0 = 0; m0 < M; m0 += kInputsPerTile) {
    const int mrows = static_cast<int>(std::min<int64_t>(kInputsPerTile, M - m0));
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    if (mrows == 3) tile<NB, 3>(xm, w, K, ym, N, bias, n0, mrows, nrows);
    else if (mrows == 2) tile<NB, 2>(xm, w, K, ym, N, bias, n0, mrows, nrows);
    else tile<NB, 1>(xm, w, K, ym, N, bias, n0, mrows, nrows);
  }
}

}  // namespace

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "skinny_linear: float32 only, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), "skinny_linear: x's last dim (",
              x.size(-1), ") must equal weight's in_features (", weight.size(1), ")");
  const auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const auto w = weight.contiguous();
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  torch::Tensor b;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N, "skinny_linear: bias must be float32 of ",
                N, " values");
    b = bias->contiguous();
    bias_ptr = b.data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  pyramid_hf::for_each_weight_tile<kRowsPerTile>(N, [&](auto nb, int64_t n0) {
    weight_rows<decltype(nb)::value>(xp, wp + n0 * K, M, K, yp, N, bias_ptr, n0, decltype(nb)::value);
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "float32 linear for calls of few rows (AVX2)");
}
