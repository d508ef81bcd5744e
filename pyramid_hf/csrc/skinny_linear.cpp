// A float32 linear for calls of few rows (speculative decoding's verification and drafting calls) on AVX2 CPUs.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]). Threads split the output features; each walks a block of NB weight
// rows once from memory and reuses it, from cache, for every MB-row group of x, with NB x MB accumulators in
// registers. Library GEMMs (MKL, oneDNN) are tuned for wide calls: at 4 to 16 rows they run 1.3-2x slower than this
// on a 2-core AVX2 EPYC, where a few-row call should cost about what reading the weights once costs.
//
// skinny_linear_int8_f32 is the same walk over int8 weights with one scale per output feature (the int8 qualifier's
// layers, pyramid_hf/quantize.py): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], float32 x and y. Each step widens 8
// int8 weights to float32 (exact) once per weight row and reuses them for every row of the tile, so a call of a few
// rows reads a quarter of the float32 kernel's bytes. torch's int8 kernel (torch._weight_int8pack_mm) takes bf16
// activations, which an AVX2 CPU handles in software, and reads the weights again for every row.
//
// Each (m, n) has a single accumulator walked over k in the same order whatever the number of rows, so a row's result
// does not depend on how many rows share the call (tests/test_cpu_kernels.py checks this bit for bit).
#include <torch/extension.h>
#include <immintrin.h>

#include <type_traits>

#include "weight_tiles.h"

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 weights from w on, as float32 lanes.
inline __m256 lanes(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 lanes(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// y[0..mrows) x [n0, n0 + nrows) for x rows starting at x (row stride K), weight rows starting at w (row stride K);
// each sum times scale[n] where scale is given (int8 weights), plus bias[n] where bias is given.
template <int NB, int MB, typename W>
void tile(const float* x, const W* w, int64_t K, float* y, int64_t N, const float* bias, const float* scale,
          int64_t n0, int mrows, int nrows) {
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; i++)
    for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  // int8 weights: the next tile's (NB rows of K, right after these in memory) are fetched at the pace these are read,
  // since rows this short (896 weights: 14 cache lines) end before the hardware prefetcher gets ahead of them (one-row
  // 4864 x 896 on a 2-core EPYC: 0.32 -> 0.20 ms). Float32 rows are 4x longer and measured no faster with it.
  const char* ahead = reinterpret_cast<const char*>(w + NB * K);
  constexpr bool kPrefetch = std::is_same<W, int8_t>::value;
  constexpr int kStepBytes = NB * 8 * static_cast<int>(sizeof(W));
  for (int64_t k = 0; k < K8; k += 8) {
    if (kPrefetch) _mm_prefetch(ahead + k / 8 * kStepBytes, _MM_HINT_T0);
    __m256 xv[MB];
    for (int j = 0; j < MB; j++) xv[j] = _mm256_loadu_ps(x + j * K + k);
    for (int i = 0; i < NB; i++) {
      const __m256 wv = lanes(w + i * K + k);
      for (int j = 0; j < MB; j++) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < nrows; i++) {
    for (int j = 0; j < mrows; j++) {
      float s = horizontal_sum(acc[i][j]);
      for (int64_t k = K8; k < K; k++) s += x[j * K + k] * static_cast<float>(w[i * K + k]);
      if (scale != nullptr) s *= scale[n0 + i];
      if (bias != nullptr) s += bias[n0 + i];
      y[j * N + n0 + i] = s;
    }
  }
}

constexpr int kRowsPerTile = 4;   // NB: weight rows walked together
constexpr int kInputsPerTile = 3; // MB: x rows per register tile (4 x 3 accumulators + 3 inputs + 1 weight = 16 ymm)

template <int NB, typename W>
void weight_rows(const float* x, const W* w, int64_t M, int64_t K, float* y, int64_t N, const float* bias,
                 const float* scale, int64_t n0, int nrows) {
  for (int64_t m0 = 0; m0 < M; m0 += kInputsPerTile) {
    const int mrows = static_cast<int>(std::min<int64_t>(kInputsPerTile, M - m0));
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    if (mrows == 3) tile<NB, 3>(xm, w, K, ym, N, bias, scale, n0, mrows, nrows);
    else if (mrows == 2) tile<NB, 2>(xm, w, K, ym, N, bias, scale, n0, mrows, nrows);
    else tile<NB, 1>(xm, w, K, ym, N, bias, scale, n0, mrows, nrows);
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
    weight_rows<decltype(nb)::value>(xp, wp + n0 * K, M, K, yp, N, bias_ptr, nullptr, n0, decltype(nb)::value);
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

torch::Tensor skinny_linear_int8_f32(const torch::Tensor& x, const torch::Tensor& weight_int8,
                                     const torch::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "skinny_linear_int8_f32: x must be float32 "
              "on CPU, got ", x.scalar_type());
  TORCH_CHECK(weight_int8.device().is_cpu() && weight_int8.dim() == 2 && weight_int8.scalar_type() == torch::kChar,
              "skinny_linear_int8_f32: weight must be a 2-d int8 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight_int8.size(1), "skinny_linear_int8_f32: x's last dim (",
              x.size(-1), ") must equal the weight's in_features (", weight_int8.size(1), ")");
  const int64_t N = weight_int8.size(0);
  TORCH_CHECK(scales.device().is_cpu() && scales.is_floating_point() && scales.numel() == N,
              "skinny_linear_int8_f32: scales must be floating point of ", N, " values");
  const auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const auto w = weight_int8.contiguous();
  const auto s = scales.to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1);
  auto y = torch::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  pyramid_hf::for_each_weight_tile<kRowsPerTile>(N, [&](auto nb, int64_t n0) {
    weight_rows<decltype(nb)::value>(xp, wp + n0 * K, M, K, yp, N, nullptr, sp, n0, decltype(nb)::value);
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "float32 linear for calls of few rows (AVX2)");
  m.def("skinny_linear_int8_f32", &skinny_linear_int8_f32,
        "int8-weight (per-row scales) linear on float32 activations for calls of few rows (AVX2)");
}
