// Paged decode attention on CPU, float32: each decode query attends over its request's blocks of
// the paged KV cache in place (no gathered copy of K/V), one task per request on torch's intra-op
// thread pool: a portable loop the compiler vectorizes (decode_rows), and an AVX-512 one
// (decode_rows_avx512) where the build has it. See worker_service/cpu_kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace {

using stepahead::exp_clamped;
#ifdef __AVX512F__
using stepahead::exp16;
using stepahead::first_lanes;
#endif

struct Geometry {
  int64_t H, kvh, G, bs, W;
  float scale, cap;  // cap <= 0: no soft-cap
  int64_t window;    // <= 0: none
  int64_t ahead;     // the kernels instantiated with PF ask for the key row this far ahead (prefetch_row)
};

// Calls f(r, start, len) for each request r in [begin, end) that attends keys: [start, len), a
// query at position seq_len - 1 over its window's keys (all earlier ones without a window), the
// length bounded by the block table's width. A request with none gets zeros for its output rows
// (`out_floats` of `op` each).
template <typename F>
inline void for_requests(int64_t begin, int64_t end, const Geometry& g, const int64_t* lens, float* op,
                         int64_t out_floats, F&& f) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t len = std::min(lens[r], g.W * g.bs);
    const int64_t start = g.window > 0 ? std::max<int64_t>(0, len - g.window) : 0;
    if (len <= start) {
      std::fill(op + r * out_floats, op + (r + 1) * out_floats, 0.0f);
      continue;
    }
    f(r, start, len);
  }
}

// How far ahead of the key row being read its pass asks for a row (into the L2). The hardware's
// stream prefetchers do not hide DRAM's latency behind a pass's compute, and they start over at
// every block, which a paged cache scatters: each pass asks for its rows itself
// (benchmarks/experiments/decode_kernel.py measures it, rows in order and scattered).
constexpr int64_t PREFETCH_KEYS = 8;

// A call whose K/V is smaller than this reads it from the caches, where asking for rows only costs
// instructions (a decode step of a small batch and context): it asks for none.
constexpr int64_t PREFETCH_MIN_BYTES = 4 << 20;

// Asks for key min(j, len - 1)'s row of `cache` into the L2 (prefetcht1: a T0 hint, into the L1, was
// slower); `table` is the request's block table. Written so that GCC 12 keeps the prefetches: its tree
// DCE deleted them from the variants with an early return or with the block passed in (check the
// kernel's disassembly for prefetcht1 after changing this).
inline void prefetch_row(const float* cache, const int64_t* table, int64_t j, int64_t len, int64_t bs,
                         int64_t row_floats) {
  j = std::min(j, len - 1);
  const char* row = reinterpret_cast<const char*>(cache + (table[j / bs] * bs + j % bs) * row_floats);
  for (int64_t off = 0; off < row_floats * static_cast<int64_t>(sizeof(float)); off += 64)
    __builtin_prefetch(row + off, 0, 2);
}

// Calls f(j, row) for the keys j in [start, len) of request r, row pointing at key j's
// [kvh, d] in `cache`, walking the block table block by block (PF: asking for the row `ahead`
// keys further).
template <int64_t D, bool PF, typename F>
inline void for_keys(const float* cache, const int64_t* table, int64_t start, int64_t len, int64_t bs,
                     int64_t row_floats, int64_t ahead, F&& f) {
  for (int64_t b = start / bs; b * bs < len; ++b) {
    const float* block = cache + table[b] * bs * row_floats;
    const int64_t lo = std::max(start, b * bs), hi = std::min(len, (b + 1) * bs);
    for (int64_t j = lo; j < hi; ++j) {
      if constexpr (PF) prefetch_row(cache, table, j + ahead, len, bs, row_floats);
      f(j, block + (j - b * bs) * row_floats);
    }
  }
}

// D > 0: the head dim known at compile time (fully unrolled, vectorized); 0: `d` at run time. PF:
// each pass asks for its rows g.ahead keys ahead (a call over more K/V than the caches hold).
template <int64_t D, bool PF>
void decode_rows(const float* qp, const float* kp, const float* vp, const int64_t* tab, const int64_t* lens,
                 const float* sink, float* op, int64_t n, int64_t d_runtime, const Geometry& g) {
  const int64_t d = D > 0 ? D : d_runtime;
  const int64_t H = g.H, G = g.G, row_floats = g.kvh * d;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [H, S]
    std::vector<float> acc(H * d);  // [H, d]
    std::vector<float> denom(H);
    std::vector<int64_t> kv_offset(H);  // query head qh reads kv head qh / G: its offset in a key's row
    for (int64_t qh = 0; qh < H; ++qh) kv_offset[qh] = (qh / G) * d;
    for_requests(begin, end, g, lens, op, H * d, [&](int64_t r, int64_t start, int64_t len) {
      const int64_t S = len - start;
      const float* qr = qp + r * H * d;  // [H, d]; query head qh reads kv head qh / G
      float* orow = op + r * H * d;
      const int64_t* table = tab + r * g.W;
      scores.resize(H * S);
      float* sc = scores.data();
      for_keys<D, PF>(kp, table, start, len, g.bs, row_floats, g.ahead, [&](int64_t j, const float* krow) {
        for (int64_t qh = 0; qh < H; ++qh) {  // scores = q k^T * scale
          const float* q = qr + qh * d;
          const float* k = krow + kv_offset[qh];
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < d; ++i) s += q[i] * k[i];
          sc[qh * S + (j - start)] = s * g.scale;
        }
      });
      if (g.cap > 0.0f) {  // soft-capped logits
        for (int64_t i = 0; i < H * S; ++i) sc[i] = std::tanh(sc[i] / g.cap) * g.cap;
      }
      for (int64_t qh = 0; qh < H; ++qh) {  // softmax over the keys (a sink joins the denominator)
        float* s = sc + qh * S;
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < S; ++t) m = std::max(m, s[t]);
        if (sink != nullptr) m = std::max(m, sink[qh]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < S; ++t) {
          s[t] = exp_clamped(s[t] - m);
          sum += s[t];
        }
        if (sink != nullptr) sum += std::exp(sink[qh] - m);
        denom[qh] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float* a = acc.data();
      for_keys<D, PF>(vp, table, start, len, g.bs, row_floats, g.ahead, [&](int64_t j, const float* vrow) {
        for (int64_t qh = 0; qh < H; ++qh) {  // acc = p v
          const float p = sc[qh * S + (j - start)];
          const float* v = vrow + kv_offset[qh];
          float* out = a + qh * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) out[i] += p * v[i];
        }
      });
      for (int64_t qh = 0; qh < H; ++qh) {
        const float inv = 1.0f / denom[qh];
        for (int64_t i = 0; i < d; ++i) orow[qh * d + i] = a[qh * d + i] * inv;
      }
    });
  });
}

#ifdef __AVX512F__
// The AVX-512 path (a build whose -march=native has AVX-512), for head dims that are a multiple of
// 16: the same attention as decode_rows, in the same memory order (each block's key rows read
// once, front to back, every head of a row before the next row: the order the cache streams
// from DRAM fastest), with less work per key. Scores are taken 16 keys at a time: each (key,
// head) product stays a vector in a small scratch, and one transposing reduction (hsum16) turns a
// head's 16 vectors into its 16 scores, where decode_rows reduced each product on its own; the
// softmax's exp is vectorized; and a K or V row is loaded once for the query heads of its KV group.

// r[i] = the sum of v[i]'s 16 lanes, i < 16.
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of the pair (a, b)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane L: the lane-L sums of v[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // pairs of u's lanes summed, then the pairs' sums: lane k of the result holds u[k]'s totals
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

template <int64_t D, bool PF>
void decode_rows_avx512(const float* qp, const float* kp, const float* vp, const int64_t* tab, const int64_t* lens,
                        const float* sink, float* op, int64_t n, const Geometry& g) {
  constexpr int64_t C = D / 16;  // vectors per head
  const int64_t H = g.H, G = g.G, kvh = g.kvh, bs = g.bs, row_floats = kvh * D;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [H, S]
    std::vector<float> accum(H * D);  // [H, D]
    std::vector<float> denom(H);
    std::vector<__m512> dots(H * 16);  // [H, 16 keys] the products of a 16-key step, unreduced
    const __m512 scale = _mm512_set1_ps(g.scale);
    for_requests(begin, end, g, lens, op, H * D, [&](int64_t r, int64_t start, int64_t len) {
      const int64_t S = len - start;
      const float* qr = qp + r * H * D;  // [H, D]
      float* orow = op + r * H * D;
      const int64_t* table = tab + r * g.W;
      scores.resize(H * S);
      float* sc = scores.data();
      for (int64_t b = start / bs; b * bs < len; ++b) {  // scores = q k^T * scale
        const float* block = kp + table[b] * bs * row_floats;
        const int64_t lo = std::max(start, b * bs), hi = std::min(len, (b + 1) * bs);
        for (int64_t j0 = lo; j0 < hi; j0 += 16) {
          const int64_t nk = std::min<int64_t>(16, hi - j0);
          for (int64_t t = 0; t < 16; ++t) {
            if (t >= nk) {
              for (int64_t qh = 0; qh < H; ++qh) dots[qh * 16 + t] = _mm512_setzero_ps();
              continue;
            }
            if constexpr (PF) prefetch_row(kp, table, j0 + t + g.ahead, len, bs, row_floats);
            const float* row = block + (j0 + t - b * bs) * row_floats;
            for (int64_t kv = 0; kv < kvh; ++kv) {
              __m512 k[C];
              for (int64_t c = 0; c < C; ++c) k[c] = _mm512_loadu_ps(row + kv * D + c * 16);
              for (int64_t qh = kv * G; qh < (kv + 1) * G; ++qh) {
                const float* q = qr + qh * D;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
                for (int64_t c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * 16), k[c], acc);
                dots[qh * 16 + t] = acc;
              }
            }
          }
          for (int64_t qh = 0; qh < H; ++qh)
            _mm512_mask_storeu_ps(sc + qh * S + (j0 - start), first_lanes(nk),
                                  _mm512_mul_ps(hsum16(dots.data() + qh * 16), scale));
        }
      }
      if (g.cap > 0.0f) {  // soft-capped logits
        for (int64_t i = 0; i < H * S; ++i) sc[i] = std::tanh(sc[i] / g.cap) * g.cap;
      }
      for (int64_t qh = 0; qh < H; ++qh) {  // softmax over the keys (a sink joins the denominator)
        float* s = sc + qh * S;
        __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < S; t += 16) {
          const __mmask16 lanes = first_lanes(std::min<int64_t>(16, S - t));
          mv = _mm512_mask_max_ps(mv, lanes, mv, _mm512_maskz_loadu_ps(lanes, s + t));
        }
        float m = _mm512_reduce_max_ps(mv);
        if (sink != nullptr) m = std::max(m, sink[qh]);
        const __m512 mb = _mm512_set1_ps(m);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < S; t += 16) {
          const __mmask16 lanes = first_lanes(std::min<int64_t>(16, S - t));
          const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + t), mb));
          _mm512_mask_storeu_ps(s + t, lanes, e);
          sum = _mm512_mask_add_ps(sum, lanes, sum, e);
        }
        float total = _mm512_reduce_add_ps(sum);
        if (sink != nullptr) total += std::exp(sink[qh] - m);
        denom[qh] = total;
      }
      std::fill(accum.begin(), accum.end(), 0.0f);
      float* a = accum.data();
      // accum = p v
      for_keys<D, PF>(vp, table, start, len, bs, row_floats, g.ahead, [&](int64_t j, const float* row) {
        for (int64_t kv = 0; kv < kvh; ++kv) {
          __m512 v[C];
          for (int64_t c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(row + kv * D + c * 16);
          for (int64_t qh = kv * G; qh < (kv + 1) * G; ++qh) {
            const __m512 p = _mm512_set1_ps(sc[qh * S + (j - start)]);
            float* o = a + qh * D;
            for (int64_t c = 0; c < C; ++c)
              _mm512_storeu_ps(o + c * 16, _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(o + c * 16)));
          }
        }
      });
      for (int64_t qh = 0; qh < H; ++qh) {
        const __m512 inv = _mm512_set1_ps(1.0f / denom[qh]);
        for (int64_t c = 0; c < C; ++c)
          _mm512_storeu_ps(orow + qh * D + c * 16, _mm512_mul_ps(_mm512_loadu_ps(a + qh * D + c * 16), inv));
      }
    });
  });
}
#endif

}  // namespace

// k, v [n, kvh, d] (any token stride, each token's heads contiguous: views into a fused qkv
// projection); k_cache, v_cache [blocks, block_size, kvh, d] contiguous; slots [n] int64: token t's
// K/V go to slot slots[t] (block * block_size + offset), every slot checked against the cache first.
// One pass where torch takes two index_copy_ and their views.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2) && slots.dim() == 1 &&
              slots.size(0) == k.size(0), "write_kv: k, v [n, kvh, d], caches [blocks, block_size, kvh, d], slots [n]");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat && slots.scalar_type() == at::kLong,
              "write_kv: float32, int64 slots");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: contiguous caches");
  const int64_t n = k.size(0), row = k.size(1) * k.size(2), num_slots = k_cache.size(0) * k_cache.size(1);
  const auto rows_contiguous = [&](const torch::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); };
  if (!rows_contiguous(k)) k = k.contiguous();
  if (!rows_contiguous(v)) v = v.contiguous();
  slots = slots.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_kv: slot ", sp[t], " outside the cache's ", num_slots);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  for (int64_t t = 0; t < n; ++t) {
    std::copy(kp + t * ks, kp + t * ks + row, kc + sp[t] * row);
    std::copy(vp + t * vs, vp + t * vs + row, vc + sp[t] * row);
  }
}

// q [n, H, d]; k_cache, v_cache [blocks, block_size, kvh, d]; tables [n, W] int64;
// seq_lens [n] int64 (keys in the cache, this step's included); window <= 0: none;
// softcap <= 0: none; sinks: [H] or an empty tensor; vectorized: the AVX-512 path where it was
// built and d is one of 16, 32, 64, 80, 96, 128, 256 (false: the portable loop, for tests).
// Returns [n, H, d].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                           torch::Tensor sinks, bool vectorized) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables, lengths");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  q = q.contiguous();
  tables = tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t kvh = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && H % kvh == 0 && tables.size(0) >= n && seq_lens.size(0) >= n, "bad shapes");
  const bool has_sinks = sinks.numel() > 0;
  if (has_sinks) {
    TORCH_CHECK(sinks.numel() == H, "sinks: one per query head");
    sinks = sinks.to(at::kFloat).contiguous();
  }
  auto out = torch::empty_like(q);
  const int64_t bs = k_cache.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t keys = 0;
  for (int64_t r = 0; r < n; ++r) keys += std::min(lens[r], tables.size(1) * bs);
  const int64_t kv_bytes = 2 * keys * kvh * d * static_cast<int64_t>(sizeof(float));
  const int64_t ahead = kv_bytes >= PREFETCH_MIN_BYTES ? std::min(PREFETCH_KEYS, bs) : 0;
  const Geometry g{H, kvh, H / kvh, bs, tables.size(1), static_cast<float>(scale),
                   static_cast<float>(softcap), window, ahead};
  const float* sink = has_sinks ? sinks.data_ptr<float>() : nullptr;
  auto args = std::make_tuple(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                              tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), sink,
                              out.data_ptr<float>(), n, d);
  auto run = [&](auto kernel) {
    std::apply([&](auto... a) { kernel(a..., g); }, args);
  };
#ifdef __AVX512F__
  if (vectorized && d % 16 == 0) {
    auto run_avx = [&](auto prefetching, auto head_dim) {
      constexpr bool pf = decltype(prefetching)::value;
      constexpr int64_t D = decltype(head_dim)::value;
      decode_rows_avx512<D, pf>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), sink,
                                out.data_ptr<float>(), n, g);
    };
    auto by_dim = [&](auto prefetching) {
      switch (d) {
        case 16: run_avx(prefetching, std::integral_constant<int64_t, 16>{}); return true;
        case 32: run_avx(prefetching, std::integral_constant<int64_t, 32>{}); return true;
        case 64: run_avx(prefetching, std::integral_constant<int64_t, 64>{}); return true;
        case 80: run_avx(prefetching, std::integral_constant<int64_t, 80>{}); return true;
        case 96: run_avx(prefetching, std::integral_constant<int64_t, 96>{}); return true;
        case 128: run_avx(prefetching, std::integral_constant<int64_t, 128>{}); return true;
        case 256: run_avx(prefetching, std::integral_constant<int64_t, 256>{}); return true;
        default: return false;
      }
    };
    if (ahead > 0 ? by_dim(std::true_type{}) : by_dim(std::false_type{})) return out;
  }
#endif
  auto portable = [&](auto prefetching) {
    constexpr bool pf = decltype(prefetching)::value;
    switch (d) {
      case 64: run(decode_rows<64, pf>); break;
      case 128: run(decode_rows<128, pf>); break;
      default: run(decode_rows<0, pf>);
    }
  };
  if (ahead > 0) {
    portable(std::true_type{});
  } else {
    portable(std::false_type{});
  }
  return out;
}
