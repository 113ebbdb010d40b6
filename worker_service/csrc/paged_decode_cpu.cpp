// Paged decode attention on CPU, float32: each decode query attends over its request's
// blocks of the paged KV cache in place (no gathered copy of K/V), one task per
// request on torch's intra-op thread pool. See worker_service/cpu_kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// q [n, H, d]; k_cache, v_cache [blocks, block_size, kvh, d]; tables [n, W] int64;
// seq_lens [n] int64 (keys in the cache, this step's included); window <= 0: none;
// softcap <= 0: none; sinks: [H] float32 or an empty tensor. Returns [n, H, d].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                           torch::Tensor sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables, lengths");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  q = q.contiguous();
  tables = tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), W = tables.size(1);
  TORCH_CHECK(k_cache.size(3) == d && H % kvh == 0 && tables.size(0) >= n && seq_lens.size(0) >= n, "bad shapes");
  const int64_t G = H / kvh;
  const bool has_sinks = sinks.numel() > 0;
  if (has_sinks) {
    TORCH_CHECK(sinks.numel() == H, "sinks: one per query head");
    sinks = sinks.to(at::kFloat).contiguous();
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float* sink = has_sinks ? sinks.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t max_len = W * bs;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [H, S]
    std::vector<float> acc(H * d);  // [H, d]
    std::vector<float> denom(H);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = std::min(lens[r], max_len);
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t S = len - start;
      const float* qr = qp + r * H * d;  // [H, d]; query head h * G + g reads kv head h
      float* orow = op + r * H * d;
      if (S <= 0) {
        std::fill(orow, orow + H * d, 0.0f);
        continue;
      }
      scores.resize(H * S);
      auto key_row = [&](int64_t j) { return kp + (tab[r * W + j / bs] * bs + j % bs) * kvh * d; };
      int64_t j = start;
      for (; j + 4 <= len; j += 4) {  // scores = q k^T * scale, four keys at a time (independent sums)
        const float* k0 = key_row(j);
        const float* k1 = key_row(j + 1);
        const float* k2 = key_row(j + 2);
        const float* k3 = key_row(j + 3);
        for (int64_t qh = 0; qh < H; ++qh) {
          const float* qg = qr + qh * d;
          const int64_t o = (qh / G) * d;
          float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
          for (int64_t i = 0; i < d; ++i) {
            s0 += qg[i] * k0[o + i];
            s1 += qg[i] * k1[o + i];
            s2 += qg[i] * k2[o + i];
            s3 += qg[i] * k3[o + i];
          }
          float* sc = scores.data() + qh * S + (j - start);
          sc[0] = s0 * fscale;
          sc[1] = s1 * fscale;
          sc[2] = s2 * fscale;
          sc[3] = s3 * fscale;
        }
      }
      for (; j < len; ++j) {
        const float* krow = key_row(j);
        for (int64_t qh = 0; qh < H; ++qh) {
          const float* qg = qr + qh * d;
          const float* kr = krow + (qh / G) * d;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < d; ++i) s += qg[i] * kr[i];
          scores[qh * S + (j - start)] = s * fscale;
        }
      }
      if (cap > 0.0f) {  // soft-capped logits
        for (int64_t i = 0; i < H * S; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
      }
      for (int64_t qh = 0; qh < H; ++qh) {  // softmax over the keys (the sink joins the denominator)
        float* sg = scores.data() + qh * S;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < S; ++t) m = std::max(m, sg[t]);
        if (has_sinks) m = std::max(m, sink[qh]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < S; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        if (has_sinks) sum += std::exp(sink[qh] - m);
        denom[qh] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (j = start; j < len; ++j) {  // acc = p v
        const float* vrow = vp + (tab[r * W + j / bs] * bs + j % bs) * kvh * d;
        for (int64_t qh = 0; qh < H; ++qh) {
          const float p = scores[qh * S + (j - start)];
          const float* vr = vrow + (qh / G) * d;
          float* ag = acc.data() + qh * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) ag[i] += p * vr[i];
        }
      }
      for (int64_t qh = 0; qh < H; ++qh) {
        const float inv = 1.0f / denom[qh];
        for (int64_t i = 0; i < d; ++i) orow[qh * d + i] = acc[qh * d + i] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (float32, CPU)");
}
