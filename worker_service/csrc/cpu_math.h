// Math shared by the CPU kernels (worker_service/csrc/*.cpp).
#pragma once

#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace stepahead {

// exp(x) for any float x, clamped to [-87, 88]: Cephes' expf (range reduction by ln 2, a degree-5
// polynomial, 2^n through the exponent bits), within a few ulp of std::exp.
inline float exp_clamped(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float t = x * 1.44269504088896341f;
  const int32_t ni = static_cast<int32_t>(t < 0.0f ? t - 0.5f : t + 0.5f);  // round(x / ln 2)
  const float n = static_cast<float>(ni);
  float r = x - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  return y * __builtin_bit_cast(float, (ni + 127) << 23);
}

#ifdef __AVX512F__
// exp_clamped on 16 lanes (GCC leaves the scalar one unvectorized: its float-int round trip).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512i ni = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)));  // nearest
  const __m512 n = _mm512_cvtepi32_ps(ni);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// The first k lanes of 16 (0 <= k <= 16).
inline __mmask16 first_lanes(int64_t k) { return static_cast<__mmask16>(k >= 16 ? 0xFFFF : (1u << k) - 1); }
#endif

}  // namespace stepahead
