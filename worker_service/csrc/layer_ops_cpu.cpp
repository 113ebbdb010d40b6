// The elementwise parts of a decoder layer on CPU, float32, each one pass over its rows where torch
// runs two to four ops (with a temporary between each): the residual add and the RMSNorm after
// it (and the RMSNorm alone), SiLU(gate) * up, and the rotary embedding applied in place. See
// worker_service/cpu_kernels.py and the modules that take them: worker_service/layers/norm.py,
// mlp.py and attention.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_math.h"

namespace {

using stepahead::exp_clamped;

// o[i] = silu(gate[i]) * up[i], i < count.
inline void silu_mul_row(const float* gate, const float* up, float* o, int64_t count) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i < count; i += 16) {
    const __mmask16 lanes = stepahead::first_lanes(count - i);
    const __m512 g = _mm512_maskz_loadu_ps(lanes, gate + i);
    const __m512 e = stepahead::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 y = _mm512_div_ps(_mm512_mul_ps(g, _mm512_maskz_loadu_ps(lanes, up + i)), _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(o + i, lanes, y);
  }
#endif
  for (; i < count; ++i) o[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
}

// o[i] = s[i] * inv * w[i], i < h: an RMSNorm's scaling, `inv` the row's 1 / rms.
inline void scale_row(const float* s, const float* w, float* o, int64_t h, float inv) {
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) o[i] = s[i] * inv * w[i];
}

constexpr int64_t kRowsGrain = 16;  // rows per task: small batches stay on the calling thread

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": a float32 CPU tensor");
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, ": contiguous in its last dim");
}

}  // namespace

// x, delta [n, h] (rows may be strided); weight [h]. Returns (x + delta, rms_norm(x + delta) * weight),
// both [n, h] contiguous: HF's `residual = residual + h; normed = norm(residual)` in one pass.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  check_rows(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && delta.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "add_rms_norm: x and delta [n, h], weight [h]");
  weight = weight.contiguous();
  const int64_t n = x.size(0), h = x.size(1);
  auto sum = torch::empty({n, h}, x.options());
  auto normed = torch::empty({n, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* np_ = normed.data_ptr<float>();
  const int64_t xs = x.stride(0), ds = delta.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n, kRowsGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* a = xp + r * xs;
      const float* b = dp + r * ds;
      float* s = sp + r * h;
      float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < h; ++i) {
        s[i] = a[i] + b[i];
        sq += s[i] * s[i];
      }
      scale_row(s, wp, np_ + r * h, h, 1.0f / std::sqrt(sq / static_cast<float>(h) + e));
    }
  });
  return {sum, normed};
}

// x [n, h] (rows may be strided); weight [h]. Returns rms_norm(x) * weight [n, h] contiguous (the
// normalisation of add_rms_norm without the add: a layer's first pre-norm, the final norm).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x [n, h], weight [h]");
  weight = weight.contiguous();
  const int64_t n = x.size(0), h = x.size(1), xs = x.stride(0);
  auto normed = torch::empty({n, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* np_ = normed.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n, kRowsGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* a = xp + r * xs;
      float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < h; ++i) sq += a[i] * a[i];
      scale_row(a, wp, np_ + r * h, h, 1.0f / std::sqrt(sq / static_cast<float>(h) + e));
    }
  });
  return normed;
}

// gate_up [n, 2 * inter] (gate | up; rows may be strided) -> [n, inter]: silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up [n, 2 * inter]");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, kRowsGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gp + r * stride;
      silu_mul_row(gate, gate + inter, op + r * inter, inter);
    }
  });
  return out;
}

// x [n, heads, d] (heads contiguous in d, any token and head strides), rotated in place over its
// whole head dim by cos, sin [n, 1, d] (sin with its first half negated: RotaryTable's signed sin),
// HF Llama's rotate-half rule: x * cos + cat(x2, x1) * sin.
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_rows(x, "x");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(0) &&
              cos.size(1) == 1 && cos.size(2) == x.size(2) && x.size(2) % 2 == 0,
              "rotary_: x [n, heads, d], cos and sin [n, 1, d]");
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, n, kRowsGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> head(d);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      for (int64_t hh = 0; hh < heads; ++hh) {
        float* v = xp + t * xs0 + hh * xs1;
        std::copy(v, v + d, head.data());
        const float* u = head.data();
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) v[i] = u[i] * c[i] + u[i + half] * s[i];
#pragma omp simd
        for (int64_t i = half; i < d; ++i) v[i] = u[i] * c[i] + u[i - half] * s[i];
      }
    }
  });
}
