// A bf16 linear for calls of few rows on CPUs with AVX512-BF16 (Intel Sapphire Rapids and later, AMD Zen 4 and
// later): the one-token steps of decoding.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); x, w and y are bf16, sums are float32 (vdpbf16ps), rounded once.
// Threads split the output features; each walks a block of NB weight rows once from memory and reuses it, from
// cache, for every MB-row group of x. A one-row call is bound by reading the weights: on a 2-core AMX Xeon seen
// here torch's bf16 kernel (oneDNN) read them at ~13 GB/s at one row, this at ~21. With more rows this kernel is
// bound by the vector units (~47 GMAC/s per core there) and AMX tiles win: `cpu_linear` times both per width.
//
// Each (m, n) has one accumulator walked over k in the same order whatever the number of rows, so a row's result
// does not depend on how many rows share the call (tests/test_cpu_kernels.py checks this bit for bit).
//
// skinny_linear_int8_bf16 is the same walk over int8 weights with one bf16 scale per output feature (the
// int8 qualifier's layers, pyramid_hf/quantize.py): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]. Each step widens 32
// int8 weights to bf16 (exact: |q| <= 127 fits bf16's 8-bit significand) once per weight row and reuses them for up to
// kInt8InputsPerTile rows of x, so a call of a few rows reads half the bytes of the bf16 kernel. torch's int8 kernel
// (torch._weight_int8pack_mm) does not use the bf16 dot products.
#include <torch/extension.h>
#include <immintrin.h>

#include "weight_tiles.h"

#include <cstring>

namespace {

constexpr int kRowsPerTile = 4;    // NB: weight rows walked together
constexpr int kInputsPerTile = 4;  // MB: x rows per register tile of bf16 weights (16 accumulators)
constexpr int kInt8InputsPerTile = 5;  // of int8 weights (20 accumulators)

inline float to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as c10::BFloat16 does (NaN kept a NaN)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 32 values from k on, as bf16 pairs for vdpbf16ps: bf16 (x, weights) as they are; int8 weights widened (exact:
// |q| <= 127 fits bf16's 8-bit significand; lanes in order k .. k + 31). The masked forms read the first `tail`.
inline __m512bh bf16_lanes(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
inline __m512bh bf16_lanes(const uint16_t* w, int64_t tail) {
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32(1) << tail) - 1, w);
}
inline __m512bh widen_int8(__m128i lo16, __m128i hi16) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo16));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi16));
  return _mm512_cvtne2ps_pbh(hi, lo);
}
inline __m512bh bf16_lanes(const int8_t* w) {
  return widen_int8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)),
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
}
inline __m512bh bf16_lanes(const int8_t* w, int64_t tail) {
  const __mmask16 lo = tail >= 16 ? __mmask16(0xffff) : __mmask16((1u << tail) - 1);
  const __mmask16 hi = tail > 16 ? __mmask16((1u << (tail - 16)) - 1) : __mmask16(0);
  return widen_int8(_mm_maskz_loadu_epi8(lo, w), _mm_maskz_loadu_epi8(hi, w + 16));
}

// 32 k per step through vdpbf16ps (pairs of bf16 products added into float32 lanes); each weight vector is loaded
// (and widened) once and used for all MB rows of x. y = sum (* scales[n] where given) (+ bias[n] where given).
template <int NB, int MB, typename W>
void tile(const uint16_t* x, const W* w, int64_t K, uint16_t* y, int64_t N, const uint16_t* bias,
          const uint16_t* scales, int64_t n0, int mrows, int nrows) {
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; i++)
    for (int j = 0; j < MB; j++) acc[i][j] = _mm512_setzero_ps();
  // full steps, then one masked step over the tail (with the mask inside one loop, GCC 12 stored every accumulator
  // to the stack on each step)
  const int64_t K32 = K & ~int64_t(31);
  for (int64_t k = 0; k < K32; k += 32) {
    __m512bh xv[MB];
    for (int j = 0; j < MB; j++) xv[j] = bf16_lanes(x + j * K + k);
    for (int i = 0; i < NB; i++) {
      const __m512bh wv = bf16_lanes(w + i * K + k);
      for (int j = 0; j < MB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  if (K32 < K) {
    __m512bh xv[MB];
    for (int j = 0; j < MB; j++) xv[j] = bf16_lanes(x + j * K + K32, K - K32);
    for (int i = 0; i < NB; i++) {
      const __m512bh wv = bf16_lanes(w + i * K + K32, K - K32);
      for (int j = 0; j < MB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  for (int i = 0; i < nrows; i++)
    for (int j = 0; j < mrows; j++) {
      float s = _mm512_reduce_add_ps(acc[i][j]);
      if (scales != nullptr) s *= to_float(scales[n0 + i]);
      if (bias != nullptr) s += to_float(bias[n0 + i]);
      y[j * N + n0 + i] = to_bf16(s);
    }
}

// All rows of x against NB weight rows (w points at the first), up to MaxMB rows of x per register tile: 4 for bf16
// weights (16 accumulators), 5 for int8 ones, whose widening is then shared by one more row.
template <int NB, int MaxMB, typename W>
void weight_rows(const uint16_t* x, const W* w, int64_t M, int64_t K, uint16_t* y, int64_t N, const uint16_t* bias,
                 const uint16_t* scales, int64_t n0, int nrows) {
  static_assert(MaxMB >= 1 && MaxMB <= 5, "register tiles of 1 to 5 rows of x");
  for (int64_t m0 = 0; m0 < M; m0 += MaxMB) {
    const int mrows = static_cast<int>(std::min<int64_t>(MaxMB, M - m0));
    const uint16_t* xm = x + m0 * K;
    uint16_t* ym = y + m0 * N;
    if constexpr (MaxMB >= 5) {
      if (mrows == 5) {
        tile<NB, 5>(xm, w, K, ym, N, bias, scales, n0, mrows, nrows);
        continue;
      }
    }
    if (mrows == 4) tile<NB, 4>(xm, w, K, ym, N, bias, scales, n0, mrows, nrows);
    else if (mrows == 3) tile<NB, 3>(xm, w, K, ym, N, bias, scales, n0, mrows, nrows);
    else if (mrows == 2) tile<NB, 2>(xm, w, K, ym, N, bias, scales, n0, mrows, nrows);
    else tile<NB, 1>(xm, w, K, ym, N, bias, scales, n0, mrows, nrows);
  }
}

torch::Tensor check_x(const torch::Tensor& x, int64_t in_features, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, name, ": x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features, name, ": x's last dim (", x.size(-1),
              ") must equal the weight's in_features (", in_features, ")");
  return x.reshape({-1, x.size(-1)}).contiguous();
}

std::vector<int64_t> out_shape(const torch::Tensor& x, int64_t N) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  return shape;
}

}  // namespace

torch::Tensor skinny_linear_bf16(const torch::Tensor& x, const torch::Tensor& weight,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16,
              "skinny_linear_bf16: weight must be a 2-d bfloat16 CPU tensor");
  const auto x2 = check_x(x, weight.size(1), "skinny_linear_bf16");
  const auto w = weight.contiguous();
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  torch::Tensor b;
  const uint16_t* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->numel() == N,
                "skinny_linear_bf16: bias must be bfloat16 of ", N, " values");
    b = bias->contiguous();
    bias_ptr = reinterpret_cast<const uint16_t*>(b.data_ptr());
  }
  auto y = torch::empty({M, N}, x2.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  pyramid_hf::for_each_weight_tile<kRowsPerTile>(N, [&](auto nb, int64_t n0) {
    weight_rows<decltype(nb)::value, kInputsPerTile>(xp, wp + n0 * K, M, K, yp, N, bias_ptr, nullptr, n0,
                                                     decltype(nb)::value);
  });
  return y.view(out_shape(x, N));
}

torch::Tensor skinny_linear_int8_bf16(const torch::Tensor& x, const torch::Tensor& weight_int8,
                                      const torch::Tensor& scales) {
  TORCH_CHECK(weight_int8.device().is_cpu() && weight_int8.dim() == 2 && weight_int8.scalar_type() == torch::kChar,
              "skinny_linear_int8_bf16: weight must be a 2-d int8 CPU tensor");
  const auto x2 = check_x(x, weight_int8.size(1), "skinny_linear_int8_bf16");
  const auto w = weight_int8.contiguous();
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && scales.numel() == N,
              "skinny_linear_int8_bf16: scales must be bfloat16 of ", N, " values");
  const auto s = scales.contiguous();
  auto y = torch::empty({M, N}, x2.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr());
  const auto* wp = w.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  pyramid_hf::for_each_weight_tile<kRowsPerTile>(N, [&](auto nb, int64_t n0) {
    weight_rows<decltype(nb)::value, kInt8InputsPerTile>(xp, wp + n0 * K, M, K, yp, N, nullptr, sp, n0,
                                                         decltype(nb)::value);
  });
  return y.view(out_shape(x, N));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear_bf16", &skinny_linear_bf16, "bf16 linear for calls of few rows (AVX512-BF16)");
  m.def("skinny_linear_int8_bf16", &skinny_linear_int8_bf16,
        "int8-weight (per-row bf16 scales) linear for calls of few rows (AVX512-BF16)");
}
