// Fused W8A8 matmul for 1-4 (or more) activation rows on x86-64 CPUs with AVX-512 VNNI (part of the one library,
// ttsx.cpp; tts_engine/cpu/cpu_ext.py calls it through ctypes; torch is loaded first, so the OpenMP runtime
// and libtorch_cpu resolve to the process's own and at::parallel_for runs on torch's thread pool).
//
// One call per linear layer: y[m, n] = (sum_k xq[m, k] * q[n, k]) * amax[m] * scale127[n]
//   xq[m, :] = round(x[m, :] * (127 / amax[m])) (int8, round half to even), amax[m] = max |x[m, :]|  (as
//   kernels.quantize_rows); the int32 sums are exact; y is written in x's dtype (fp32, or bf16 rounded to nearest even).
//
// Weight layout (ttsx_pack): u8 = q + 128 (q in [-127, 127] -> [1, 255]) in blocks of 16 output rows:
//   packed[b][k4][r][j] = q[16 b + r][4 k4 + j] + 128, b < Np / 16, k4 < Kp / 4 (N padded to 16, K to 16; padding is
//   128, i.e. q = 0). One 64-byte vector holds 4 consecutive k of 16 rows: vpdpbusd (u8 x s8 -> s32, 4 products per
//   lane) multiplies it by 4 activation bytes broadcast to every lane, so a block is read as one sequential stream.
//   sum_k (q + 128) * xq = sum_k q * xq + 128 * sum_k xq: the offset costs one subtraction per activation row.
#pragma once   // one translation unit includes every source once (ttsx.cpp)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <string>
#include <cmath>
#include <vector>
#include <ATen/Parallel.h>

namespace {

constexpr int64_t BLK = 16;   // output rows per block
constexpr int64_t KU = 16;    // k per unrolled step (4 vectors of 4 k)

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// ---- the CPU level our kernels run at (every library that includes this file: cpu_ext, fused_step, ...) ---------
// 1 AVX2 + FMA, 2 AVX-512F/BW/VL (Skylake-X), 3 + AVX-512 VNNI (Cascade Lake, Ice Lake), 4 + AVX-512 BF16 (Zen 4,
// Sapphire Rapids); 0 none of these. The level is what cpuid says, or lower where TTS_CPU_ISA asks for it (avx2 /
// avx512 / avx512vnni / avx512bf16 / native: to run and time the lower paths on a CPU that has the higher ones);
// never higher than cpuid. Each kernel maps the level to its own paths (ttsx_isa, ttsx_snake_isa, ttsf_bf16_isa).
int level_of_cpu() {
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")))
    return 1;
  if (!__builtin_cpu_supports("avx512vnni")) return 2;
  return __builtin_cpu_supports("avx512bf16") ? 4 : 3;
}

int level_asked() {   // TTS_CPU_ISA -> a level (99: native, or unset / unknown: the Python side says so)
  const char* e = getenv("TTS_CPU_ISA");
  if (!e) return 99;
  std::string v(e);
  for (auto& c : v) c = (char)tolower((unsigned char)c);
  v.erase(std::remove_if(v.begin(), v.end(), [](char c) { return c == '-' || c == '_' || c == ' '; }), v.end());
  if (v == "avx2") return 1;
  if (v == "avx512") return 2;
  if (v == "avx512vnni") return 3;
  if (v == "avx512bf16") return 4;
  return 99;
}

int g_level = -1;   // resolved on first use; ttsx_set_level changes it (tests, cpu_ext.py)

inline int level() {
  int l = g_level;
  if (l < 0) l = g_level = std::min(level_of_cpu(), level_asked());
  return l;
}

inline uint16_t f32_to_bf16(float f) {   // round to nearest even (finite values; NaN stays NaN)
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// 16 elements of a row (fp32 or bf16) from x + k as fp32, lanes past `mask` zero
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 load16(const void* x, int is_bf16, int64_t k, __mmask16 mask) {
  if (is_bf16) {
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t*)x + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(mask, (const float*)x + k);
}

// x row (fp32 or bf16) -> xq (int8, Kp bytes, zero padded); returns amax (as a float) and the sum of xq
__attribute__((target("avx512f,avx512bw,avx512vl")))
void quantize_row(const void* x, int is_bf16, int64_t K, int64_t Kp, int8_t* xq, float* amax_out, int32_t* sum_out) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
    mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x, is_bf16, k, mask)));
  }
  float amax = _mm512_reduce_max_ps(mx);
  if (!(amax >= 1e-30f)) amax = 1e-30f;   // kernels.quantize_rows: clamp_(min=1e-30)
  // torch evaluates `127.0 / amax` as reciprocal(amax) * 127 (two fp32 roundings): the same here
  const float inv1 = 1.0f / amax;
  const __m512 inv = _mm512_set1_ps(inv1 * 127.0f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
    // x * (127 / amax) rounded half to even (the default MXCSR mode), as torch.round; |v| <= 127
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, is_bf16, k, mask), inv));
    sum = _mm512_add_epi32(sum, v);
    _mm_mask_storeu_epi8(xq + k, mask, _mm512_cvtsepi32_epi8(v));
  }
  for (int64_t k = K; k < Kp; ++k) xq[k] = 0;
  *amax_out = amax;
  *sum_out = _mm512_reduce_add_epi32(sum);
}

// Rows per pass over a weight block (blocks, blocks4): the block is read from memory once for up to this many
// activation rows (more rows read it again, from cache).
constexpr int64_t MAXR = 8;

// R activation rows (R = 1..8) x one block of 16 output rows -> acc[R][16] (raw sums with the +128 offset).
// vpdpbusd's latency is hidden by U independent accumulators per row (4 for up to 4 rows, 2 for more: R * U <= 16
// of the 32 vector registers). At 4+ rows the loop is bound by the vpdpbusd count (one per 64 weight bytes and
// row), not by the weight stream: one pass for up to 8 rows keeps the stream at one read per weight byte.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
inline void block_rows(const uint8_t* w, const int8_t* const* xq, int64_t Kp, int32_t* acc) {
  static_assert(R >= 1 && R <= MAXR, "1..MAXR rows");
  constexpr int U = R <= 4 ? 4 : 2;   // independent accumulators per row
  __m512i a[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) a[r][u] = _mm512_setzero_si512();
  const int64_t steps = Kp / 4;   // 4-byte k groups, a multiple of 4
  for (int64_t s = 0; s < steps; s += 4) {
    const uint8_t* ws = w + s * 64;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i wv = _mm512_loadu_si512((const void*)(ws + j * 64));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        memcpy(&xv, xq[r] + (s + j) * 4, 4);
        a[r][j % U] = _mm512_dpbusd_epi32(a[r][j % U], wv, _mm512_set1_epi32(xv));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512i t = a[r][0];
    for (int u = 1; u < U; ++u) t = _mm512_add_epi32(t, a[r][u]);
    _mm512_storeu_si512((void*)(acc + r * BLK), t);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void blocks(const uint8_t* packed, const int8_t* xq, int64_t M, int64_t Kp, int64_t b0, int64_t b1, int32_t* acc_all,
            int64_t Np) {
  int32_t acc[MAXR * BLK];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* w = packed + b * BLK * Kp;
    for (int64_t m0 = 0; m0 < M; m0 += MAXR) {   // every row group reads this block (from cache after the first)
      const int64_t R = M - m0 < MAXR ? M - m0 : MAXR;
      const int8_t* rows[MAXR];
      for (int64_t r = 0; r < R; ++r) rows[r] = xq + (m0 + r) * Kp;
      switch (R) {
        case 1: block_rows<1>(w, rows, Kp, acc); break;
        case 2: block_rows<2>(w, rows, Kp, acc); break;
        case 3: block_rows<3>(w, rows, Kp, acc); break;
        case 4: block_rows<4>(w, rows, Kp, acc); break;
        case 5: block_rows<5>(w, rows, Kp, acc); break;
        case 6: block_rows<6>(w, rows, Kp, acc); break;
        case 7: block_rows<7>(w, rows, Kp, acc); break;
        default: block_rows<8>(w, rows, Kp, acc); break;
      }
      for (int64_t r = 0; r < R; ++r) memcpy(acc_all + (m0 + r) * Np + b * BLK, acc + r * BLK, BLK * 4);
    }
  }
}

// fp32 -> bf16 (round to nearest even, NaN stays NaN) of 16 lanes, as f32_to_bf16
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m256i bf16_of(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                       _mm512_set1_epi32(1)))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i q = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(q);
}

// y[n] = v[n] for n in [n0, n1) of one output row, in x's dtype: v[n] = (float)(acc[n] - off) * (am * scale[n])
// (W8A8: the same fp32 operations, in the same order, as the scalar loop and kernels.w8a8_int_mm), or, with
// scale == NULL, v[n] = facc[n] * am (W4A8). acc_out (W8A8, or NULL) gets acc[n] - off.
__attribute__((target("avx512f,avx512bw,avx512vl")))
void finish_row(const int32_t* acc, const float* facc, int32_t off, float am, const float* scale, int64_t n0,
                int64_t n1, int is_bf16, void* y, int32_t* acc_out) {
  const __m512 amv = _mm512_set1_ps(am);
  const __m512i offv = _mm512_set1_epi32(off);
  for (int64_t n = n0; n < n1; n += 16) {
    const __mmask16 mask = n1 - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n1 - n)) - 1);
    __m512 v;
    if (scale) {
      const __m512i sm = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(mask, acc + n), offv);
      if (acc_out) _mm512_mask_storeu_epi32(acc_out + n, mask, sm);
      v = _mm512_mul_ps(_mm512_cvtepi32_ps(sm), _mm512_mul_ps(amv, _mm512_maskz_loadu_ps(mask, scale + n)));
    } else {
      v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, facc + n), amv);
    }
    if (is_bf16) _mm256_mask_storeu_epi16((uint16_t*)y + n, mask, bf16_of(v));
    else _mm512_mask_storeu_ps((float*)y + n, mask, v);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
int64_t read_chunk(const uint8_t* q, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 256 <= n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512((const void*)(q + i)));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512((const void*)(q + i + 64)));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512((const void*)(q + i + 128)));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512((const void*)(q + i + 192)));
  }
  return _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
}

// read_chunk with 32-byte loads (AVX2): the plain read on a CPU (or a forced level) without AVX-512
__attribute__((target("avx2")))
int64_t read_chunk_avx2(const uint8_t* q, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 128 <= n; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i*)(q + i)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i*)(q + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i*)(q + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i*)(q + i + 96)));
  }
  alignas(32) int64_t t[4];
  _mm256_store_si256((__m256i*)t, _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
  return t[0] + t[1] + t[2] + t[3];
}


// ---- W4A8: int4 weights (groups of G = 64 input columns, per group and row a bf16 scale and zero:
// w = (q - 8) * scale + zero, q in 0..15, as quant.Int4Linear) x int8 activation rows.
// Layout (ttsx_pack4): per block of 16 output rows and per group, 8 vectors of 64 bytes: vector t (t < 8) holds
// k4-step t of the group in its low nibbles and k4-step t + 8 in its high nibbles (4 consecutive k of 16 rows per
// step, as the int8 layout), then one vector of 16 bf16 scales and 16 bf16 zeros (the block's rows): 576 bytes.
// y = amax / 127 * sum_g [ scale * (sum_{k in g} q * xq - 8 * sum_{k in g} xq) + zero * sum_{k in g} xq ].
constexpr int64_t G4 = 64;
constexpr int64_t GBYTES = 8 * 64 + 64;

// R = 1..8 rows (3 R accumulators + 5 vectors of the loop: at most 29 of the 32 registers)
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
inline void block4_rows(const uint8_t* w, const int8_t* const* xq, const int32_t* const* gsum, int64_t ng,
                        float* out) {
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = w + g * GBYTES;
    _mm_prefetch((const char*)(wg + 1152), _MM_HINT_T0);
    _mm_prefetch((const char*)(wg + 1216), _MM_HINT_T0);
    __m512i a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i v = _mm512_loadu_si512((const void*)(wg + t * 64));
      const __m512i lo = _mm512_and_si512(v, lo4);
      const __m512i hi = _mm512_andnot_si512(lo4, v);   // 16 * the high nibbles (no shift: one op less per vector)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x0, x1;
        memcpy(&x0, xq[r] + g * G4 + t * 4, 4);
        memcpy(&x1, xq[r] + g * G4 + (t + 8) * 4, 4);
        a[r][0] = _mm512_dpbusd_epi32(a[r][0], lo, _mm512_set1_epi32(x0));
        a[r][1] = _mm512_dpbusd_epi32(a[r][1], hi, _mm512_set1_epi32(x1));
      }
    }
    const __m512i sz = _mm512_loadu_si512((const void*)(wg + 512));
    const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(sz)), 16));
    const __m512 ze = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(sz, 1)), 16));
    for (int r = 0; r < R; ++r) {
      const int32_t gs = gsum[r][g];
      const __m512i hs = _mm512_srai_epi32(a[r][1], 4);   // exact: every product of the high nibbles is 16 q * x
      const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(a[r][0], hs), _mm512_set1_epi32(8 * gs));
      f[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(d), f[r]);
      f[r] = _mm512_fmadd_ps(ze, _mm512_set1_ps((float)gs), f[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * BLK, f[r]);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void blocks4(const uint8_t* packed, const int8_t* xq, const int32_t* gsum, int64_t M, int64_t Kp, int64_t b0,
             int64_t b1, float* acc_all, int64_t Np) {
  const int64_t ng = Kp / G4;
  float acc[MAXR * BLK];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* w = packed + b * ng * GBYTES;
    for (int64_t m0 = 0; m0 < M; m0 += MAXR) {
      const int64_t R = M - m0 < MAXR ? M - m0 : MAXR;
      const int8_t* rows[MAXR];
      const int32_t* gs[MAXR];
      for (int64_t r = 0; r < R; ++r) { rows[r] = xq + (m0 + r) * Kp; gs[r] = gsum + (m0 + r) * ng; }
      switch (R) {
        case 1: block4_rows<1>(w, rows, gs, ng, acc); break;
        case 2: block4_rows<2>(w, rows, gs, ng, acc); break;
        case 3: block4_rows<3>(w, rows, gs, ng, acc); break;
        case 4: block4_rows<4>(w, rows, gs, ng, acc); break;
        case 5: block4_rows<5>(w, rows, gs, ng, acc); break;
        case 6: block4_rows<6>(w, rows, gs, ng, acc); break;
        case 7: block4_rows<7>(w, rows, gs, ng, acc); break;
        default: block4_rows<8>(w, rows, gs, ng, acc); break;
      }
      for (int64_t r = 0; r < R; ++r) memcpy(acc_all + (m0 + r) * Np + b * BLK, acc + r * BLK, BLK * 4);
    }
  }
}

// ---- AVX2 (no VNNI): the same packed layout and the same exact int32 sums, with 16-bit products: the u8 weights
// (q + 128, up to 255) are split into the words of their even and odd bytes (vpand / vpsrlw: no shuffle) and
// multiplied by the int8 activation pairs with vpmaddwd (no saturation, unlike vpmaddubsw: 255 * 127 * 2 > 32767).
// Lane r of each 8-row half holds row r's sums, as vpdpbusd leaves them. |sum| <= 255 * 127 * Kp: exact in int32.
__attribute__((target("avx2,fma")))
void quantize_row_avx2(const void* x, int is_bf16, int64_t K, int64_t Kp, int8_t* xq, float* amax_out,
                       int32_t* sum_out) {
  auto at = [&](int64_t k) -> float {
    if (is_bf16) { uint32_t u = (uint32_t)((const uint16_t*)x)[k] << 16; float f; memcpy(&f, &u, 4); return f; }
    return ((const float*)x)[k];
  };
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(at(k)));
  if (!(amax >= 1e-30f)) amax = 1e-30f;
  const float inv1 = 1.0f / amax;
  const float inv = inv1 * 127.0f;
  int32_t s = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int v = _mm_cvtss_si32(_mm_set_ss(at(k) * inv));   // round half to even (MXCSR default)
    xq[k] = (int8_t)std::max(-127, std::min(127, v));
    s += xq[k];
  }
  for (int64_t k = K; k < Kp; ++k) xq[k] = 0;
  *amax_out = amax;
  *sum_out = s;
}

// x0..x3 of each 4-k step of R rows as the two dwords (x0 | x2 << 16, x1 | x3 << 16) vpmaddwd multiplies by:
// xp[r][2 s], xp[r][2 s + 1] (sign-extended 16-bit halves)
inline void pairs_of_rows(const int8_t* const* xq, int64_t R, int64_t Kp, int32_t* xp) {
  for (int64_t r = 0; r < R; ++r) {
    const int8_t* x = xq[r];
    int32_t* o = xp + r * (Kp / 2);
    for (int64_t s = 0; s < Kp / 4; ++s) {
      o[2 * s] = (int32_t)(((uint32_t)(uint16_t)(int16_t)x[4 * s]) | ((uint32_t)(uint16_t)(int16_t)x[4 * s + 2] << 16));
      o[2 * s + 1] = (int32_t)(((uint32_t)(uint16_t)(int16_t)x[4 * s + 1]) | ((uint32_t)(uint16_t)(int16_t)x[4 * s + 3] << 16));
    }
  }
}

// R = 1..4 activation rows x one block: each 32-byte half of a step's vector (8 rows) as words of its even bytes
// (k0, k2) and of its odd bytes (k1, k3), vpmaddwd by the activation pairs (x0, x2) and (x1, x3): lane r of a half
// holds row r's 4 products (2 R accumulators + 5 loop vectors of the 16 registers).
template <int R>
__attribute__((target("avx2,fma")))
inline void block_rows_avx2(const uint8_t* w, const int32_t* xp, int64_t Kp, int32_t* acc) {
  const int64_t xs = Kp / 2;
  const __m256i lo8 = _mm256_set1_epi16(0x00ff);
  __m256i a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
  const int64_t steps = Kp / 4;
#pragma GCC unroll 2
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* ws = w + s * 64;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(ws + h * 32));
      const __m256i ev = _mm256_and_si256(v, lo8);
      const __m256i od = _mm256_srli_epi16(v, 8);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = xp + r * xs + s * 2;
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(ev, _mm256_set1_epi32(xr[0])),
                                           _mm256_madd_epi16(od, _mm256_set1_epi32(xr[1])));
        a[r][h] = _mm256_add_epi32(a[r][h], p);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256((__m256i*)(acc + r * BLK), a[r][0]);
    _mm256_storeu_si256((__m256i*)(acc + r * BLK + 8), a[r][1]);
  }
}

// blocks' AVX2 twin (same arguments, same results): passes of up to 4 rows over a block, the block from cache after
// the first pass; the activation pairs of every row made once per call
__attribute__((target("avx2,fma")))
void blocks_avx2(const uint8_t* packed, const int8_t* xq, int64_t M, int64_t Kp, int64_t b0, int64_t b1,
                 int32_t* acc_all, int64_t Np) {
  constexpr int64_t RM = 4;
  int32_t acc[RM * BLK];
  std::vector<int32_t> xpv(M * (Kp / 2));
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* row = xq + m * Kp;
    pairs_of_rows(&row, 1, Kp, xpv.data() + m * (Kp / 2));
  }
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* w = packed + b * BLK * Kp;
    for (int64_t m0 = 0; m0 < M; m0 += RM) {
      const int64_t R = std::min<int64_t>(M - m0, RM);
      const int32_t* xp = xpv.data() + m0 * (Kp / 2);
      switch (R) {
        case 1: block_rows_avx2<1>(w, xp, Kp, acc); break;
        case 2: block_rows_avx2<2>(w, xp, Kp, acc); break;
        case 3: block_rows_avx2<3>(w, xp, Kp, acc); break;
        default: block_rows_avx2<4>(w, xp, Kp, acc); break;
      }
      for (int64_t r = 0; r < R; ++r) memcpy(acc_all + (m0 + r) * Np + b * BLK, acc + r * BLK, BLK * 4);
    }
  }
}

// ---- W4A8 on AVX2 (level 1; blocks4_bw at level 2): the packed4 layout and the exact per-group int32 sums of
// block4_rows. The nibbles q (0..15, unsigned) times the int8 activations with vpmaddubsw (u8 x s8 pairs -> s16:
// |2 * 15 * 127| = 3810, it never saturates), the group's 8 steps summed in 16 bits (|8 * 3810| = 30480 < 32767:
// exact), then vpmaddwd by 1: int32 per row (4 products of a step, over the 8 steps). A 64-byte vector holds 16 rows;
// AVX2 takes it as two halves of 8 rows (bytes 0-31: rows 0-7). The per-group epilogue is block4_rows's lane by lane
// (d = sums - 8 * gsum exact; f = fma(scale, d, f); f = fma(zero, gsum, f)): the same fp32 operations in the same
// order, so the same bits as the AVX-512 VNNI path. R = 1..2 rows (15 of the 16 registers at 2).
template <int R>
__attribute__((target("avx2,fma")))
inline void block4_rows_avx2(const uint8_t* w, const int8_t* const* xq, const int32_t* const* gsum, int64_t ng,
                             float* out) {
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  const __m256i one16 = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = w + g * GBYTES;
    _mm_prefetch((const char*)(wg + 1152), _MM_HINT_T0);
    _mm_prefetch((const char*)(wg + 1216), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i a[R][2];
      for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wg + t * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(v, lo4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        for (int r = 0; r < R; ++r) {
          int32_t x0, x1;
          memcpy(&x0, xq[r] + g * G4 + t * 4, 4);
          memcpy(&x1, xq[r] + g * G4 + (t + 8) * 4, 4);
          a[r][0] = _mm256_add_epi16(a[r][0], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)));
          a[r][1] = _mm256_add_epi16(a[r][1], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
        }
      }
      const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(wg + 512 + h * 16))), 16));
      const __m256 ze = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(wg + 544 + h * 16))), 16));
      for (int r = 0; r < R; ++r) {
        const int32_t gs = gsum[r][g];
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(a[r][0], one16), _mm256_madd_epi16(a[r][1], one16));
        const __m256i d = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * gs));
        f[r][h] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(d), f[r][h]);
        f[r][h] = _mm256_fmadd_ps(ze, _mm256_set1_ps((float)gs), f[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * BLK, f[r][0]);
    _mm256_storeu_ps(out + r * BLK + 8, f[r][1]);
  }
}

// 8 bf16 (a group's scales or zeros) as fp32
__attribute__((target("avx2,fma")))
inline __m256 bf16x8_avx2(const uint8_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// the exact int32 sums of both nibbles' 16-bit sums (vpmaddwd by 1), less 8 * gsum (g8)
__attribute__((target("avx2,fma")))
inline __m256i sums32_avx2(__m256i lo, __m256i hi, __m256i g8) {
  const __m256i one16 = _mm256_set1_epi16(1);
  return _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(lo, one16), _mm256_madd_epi16(hi, one16)), g8);
}

// 1 row: both halves of each weight vector against one pair of activation broadcasts (half the broadcasts of
// block4_rows_avx2<1>: 4 16-bit accumulators, 2 fp32 sums, 5 temporaries: 13 of the 16 registers); the same integer
// sums and fp32 operations per lane (same bits).
__attribute__((target("avx2,fma")))
inline void block4_row1_avx2(const uint8_t* w, const int8_t* xq, const int32_t* gsum, int64_t ng, float* out) {
  __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = w + g * GBYTES;
    _mm_prefetch((const char*)(wg + 1152), _MM_HINT_T0);
    _mm_prefetch((const char*)(wg + 1216), _MM_HINT_T0);
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00;   // a[half][nibble]
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      int32_t x0, x1;
      memcpy(&x0, xq + g * G4 + t * 4, 4);
      memcpy(&x1, xq + g * G4 + (t + 8) * 4, 4);
      const __m256i xb0 = _mm256_set1_epi32(x0), xb1 = _mm256_set1_epi32(x1);
      const __m256i v0 = _mm256_loadu_si256((const __m256i*)(wg + t * 64));
      const __m256i v1 = _mm256_loadu_si256((const __m256i*)(wg + t * 64 + 32));
      a00 = _mm256_add_epi16(a00, _mm256_maddubs_epi16(_mm256_and_si256(v0, lo4), xb0));
      a01 = _mm256_add_epi16(a01, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), lo4), xb1));
      a10 = _mm256_add_epi16(a10, _mm256_maddubs_epi16(_mm256_and_si256(v1, lo4), xb0));
      a11 = _mm256_add_epi16(a11, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), lo4), xb1));
    }
    const int32_t gs = gsum[g];
    const __m256i g8 = _mm256_set1_epi32(8 * gs);
    const __m256 gf = _mm256_set1_ps((float)gs);
    const __m256i d0 = sums32_avx2(a00, a01, g8), d1 = sums32_avx2(a10, a11, g8);
    f0 = _mm256_fmadd_ps(bf16x8_avx2(wg + 544), gf, _mm256_fmadd_ps(bf16x8_avx2(wg + 512), _mm256_cvtepi32_ps(d0), f0));
    f1 = _mm256_fmadd_ps(bf16x8_avx2(wg + 560), gf, _mm256_fmadd_ps(bf16x8_avx2(wg + 528), _mm256_cvtepi32_ps(d1), f1));
  }
  _mm256_storeu_ps(out, f0);
  _mm256_storeu_ps(out + 8, f1);
}

// 3-4 rows (several streams): one half-block (8 rows of weights) at a time, the fp32 sums `out` kept in L1 between
// groups, and both nibbles' products summed in one 16-bit lane over 4 steps (|4 * 2 * 3810| = 30480 < 32767: exact)
// before vpmaddwd: 2 R + 6 of the 16 registers. The same integer sums and fp32 operations as block4_rows (same bits).
template <int R>
__attribute__((target("avx2,fma")))
inline void block4_rows_avx2_many(const uint8_t* w, const int8_t* const* xq, const int32_t* const* gsum, int64_t ng,
                                  float* out) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < BLK; ++i) out[r * BLK + i] = 0.f;
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  const __m256i one16 = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = w + g * GBYTES;
    _mm_prefetch((const char*)(wg + 1152), _MM_HINT_T0);
    _mm_prefetch((const char*)(wg + 1216), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i s32[R];
      for (int r = 0; r < R; ++r) s32[r] = _mm256_setzero_si256();
      for (int tb = 0; tb < 8; tb += 4) {
        __m256i s16[R];
        for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int t = tb; t < tb + 4; ++t) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(wg + t * 64 + h * 32));
          const __m256i lo = _mm256_and_si256(v, lo4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
          for (int r = 0; r < R; ++r) {
            int32_t x0, x1;
            memcpy(&x0, xq[r] + g * G4 + t * 4, 4);
            memcpy(&x1, xq[r] + g * G4 + (t + 8) * 4, 4);
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)));
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
          }
        }
        for (int r = 0; r < R; ++r) s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(s16[r], one16));
      }
      const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(wg + 512 + h * 16))), 16));
      const __m256 ze = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(wg + 544 + h * 16))), 16));
      for (int r = 0; r < R; ++r) {
        const int32_t gs = gsum[r][g];
        const __m256i d = _mm256_sub_epi32(s32[r], _mm256_set1_epi32(8 * gs));
        float* o = out + r * BLK + h * 8;
        __m256 f = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(d), _mm256_loadu_ps(o));
        _mm256_storeu_ps(o, _mm256_fmadd_ps(ze, _mm256_set1_ps((float)gs), f));
      }
    }
  }
}

// blocks4's AVX2 twin (same arguments, same results): passes of up to 4 rows over a block (1-2 rows: registers
// only, block4_rows_avx2; 3-4: block4_rows_avx2_many), the block from cache after the first pass
__attribute__((target("avx2,fma")))
void blocks4_avx2(const uint8_t* packed, const int8_t* xq, const int32_t* gsum, int64_t M, int64_t Kp, int64_t b0,
                  int64_t b1, float* acc_all, int64_t Np) {
  const int64_t ng = Kp / G4;
  float acc[4 * BLK];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* w = packed + b * ng * GBYTES;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t R = std::min<int64_t>(4, M - m0);
      const int8_t* rows[4];
      const int32_t* gs[4];
      for (int64_t r = 0; r < 4; ++r) {
        const int64_t m = std::min(m0 + r, M - 1);
        rows[r] = xq + m * Kp;
        gs[r] = gsum + m * ng;
      }
      switch (R) {
        case 1: block4_row1_avx2(w, rows[0], gs[0], ng, acc); break;
        case 2: block4_rows_avx2<2>(w, rows, gs, ng, acc); break;
        case 3: block4_rows_avx2_many<3>(w, rows, gs, ng, acc); break;
        default: block4_rows_avx2_many<4>(w, rows, gs, ng, acc); break;
      }
      for (int64_t r = 0; r < R; ++r) memcpy(acc_all + (m0 + r) * Np + b * BLK, acc + r * BLK, BLK * 4);
    }
  }
}

// finish_row without AVX-512 (the AVX2 paths): the same fp32 operations per element, in the same order
void finish_row_any(const int32_t* acc, const float* facc, int32_t off, float am, const float* scale, int64_t n0,
                    int64_t n1, int is_bf16, void* y, int32_t* acc_out) {
  for (int64_t n = n0; n < n1; ++n) {
    float v;
    if (scale) {
      const int32_t sm = acc[n] - off;
      if (acc_out) acc_out[n] = sm;
      v = (float)sm * (am * scale[n]);
    } else {
      v = facc[n] * am;
    }
    if (is_bf16) ((uint16_t*)y)[n] = f32_to_bf16(v);
    else ((float*)y)[n] = v;
  }
}

// ---- AVX-512 without VNNI (level 2: Skylake-X / Skylake-SP; isa 3, "avx512bw"): the VNNI paths' layouts and their
// exact int32 sums with 512-bit vpmaddwd / vpmaddubsw, so the same bits as blocks / blocks4 (and as the AVX2 path).
//
// W8A8: a 64-byte vector of the packed layout holds 4 k (bytes 4 r .. 4 r + 3) of 16 rows r. As 32 words its even
// bytes (v & 0xff: k0, k2 of row r in the two words of lane r) and its odd bytes (v >> 8: k1, k3) are u8 weights
// (q + 128, up to 255) widened to 16 bits without a shuffle; vpmaddwd by the activation pairs (x0, x2) and (x1, x3)
// (16-bit, sign-extended, one dword each, broadcast: pairs_of_rows) gives lane r the row's 4 products in two halves:
// no saturation, and the 16 rows stay in the 16 lanes as vpdpbusd leaves them (the AVX2 path's scheme, 512 bits).
constexpr int64_t MAXR_BW = 8;

// R activation rows (1..8) x one block of 16 output rows -> acc[R][16] (raw sums with the +128 offset, as
// block_rows). U independent accumulators per row (4 steps unrolled) hide vpaddd's chain.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void block_rows_bw(const uint8_t* w, const int32_t* xp, int64_t Kp, int32_t* acc) {
  static_assert(R >= 1 && R <= MAXR_BW, "1..MAXR_BW rows");
  constexpr int U = R <= 2 ? 4 : R <= 4 ? 2 : 1;   // accumulators per row: R * U * ... <= 8..16 of 32 registers
  const int64_t xs = Kp / 2;                       // a row's stride in xp (dwords)
  const __m512i lo8 = _mm512_set1_epi16(0x00ff);
  __m512i a[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) a[r][u] = _mm512_setzero_si512();
  const int64_t steps = Kp / 4;   // a multiple of 4
  for (int64_t s = 0; s < steps; s += 4) {
    const uint8_t* ws = w + s * 64;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512((const void*)(ws + j * 64));
      const __m512i ev = _mm512_and_si512(v, lo8);     // k0, k2 of each row (16-bit)
      const __m512i od = _mm512_srli_epi16(v, 8);      // k1, k3
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = xp + r * xs + (s + j) * 2;
        const __m512i p = _mm512_add_epi32(_mm512_madd_epi16(ev, _mm512_set1_epi32(xr[0])),
                                           _mm512_madd_epi16(od, _mm512_set1_epi32(xr[1])));
        a[r][j % U] = _mm512_add_epi32(a[r][j % U], p);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512i t = a[r][0];
    for (int u = 1; u < U; ++u) t = _mm512_add_epi32(t, a[r][u]);
    _mm512_storeu_si512((void*)(acc + r * BLK), t);
  }
}

// blocks' twin without VNNI (same arguments, same results): passes of up to 8 rows over a block, the block from
// cache after the first pass; the activation pairs of every row made once per call
__attribute__((target("avx512f,avx512bw,avx512vl")))
void blocks_bw(const uint8_t* packed, const int8_t* xq, int64_t M, int64_t Kp, int64_t b0, int64_t b1, int32_t* acc_all,
               int64_t Np) {
  int32_t acc[MAXR_BW * BLK];
  std::vector<int32_t> xpv(M * (Kp / 2));
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* row = xq + m * Kp;
    pairs_of_rows(&row, 1, Kp, xpv.data() + m * (Kp / 2));
  }
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* w = packed + b * BLK * Kp;
    for (int64_t m0 = 0; m0 < M; m0 += MAXR_BW) {
      const int64_t R = std::min<int64_t>(M - m0, MAXR_BW);
      const int32_t* xp = xpv.data() + m0 * (Kp / 2);
      switch (R) {
        case 1: block_rows_bw<1>(w, xp, Kp, acc); break;
        case 2: block_rows_bw<2>(w, xp, Kp, acc); break;
        case 3: block_rows_bw<3>(w, xp, Kp, acc); break;
        case 4: block_rows_bw<4>(w, xp, Kp, acc); break;
        case 5: block_rows_bw<5>(w, xp, Kp, acc); break;
        case 6: block_rows_bw<6>(w, xp, Kp, acc); break;
        case 7: block_rows_bw<7>(w, xp, Kp, acc); break;
        default: block_rows_bw<8>(w, xp, Kp, acc); break;
      }
      for (int64_t r = 0; r < R; ++r) memcpy(acc_all + (m0 + r) * Np + b * BLK, acc + r * BLK, BLK * 4);
    }
  }
}

// W4A8: block4_rows with vpmaddubsw (u8 nibbles x s8 activations -> s16 pairs, |2 * 15 * 127| = 3810: never
// saturates), a group's 8 steps summed in 16 bits (|8 * 3810| = 30480 < 32767: exact), then vpmaddwd by 1: lane r
// holds row r's 4 products per step, as vpdpbusd leaves them; the epilogue is block4_rows's (same fp32 operations
// in the same order: the same bits). R = 1..4 rows (blocks4_bw).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl")))
inline void block4_rows_bw(const uint8_t* w, const int8_t* const* xq, const int32_t* const* gsum, int64_t ng,
                           float* out) {
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  const __m512i one16 = _mm512_set1_epi16(1);
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = w + g * GBYTES;
    _mm_prefetch((const char*)(wg + 1152), _MM_HINT_T0);
    _mm_prefetch((const char*)(wg + 1216), _MM_HINT_T0);
    __m512i a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i v = _mm512_loadu_si512((const void*)(wg + t * 64));
      const __m512i lo = _mm512_and_si512(v, lo4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x0, x1;
        memcpy(&x0, xq[r] + g * G4 + t * 4, 4);
        memcpy(&x1, xq[r] + g * G4 + (t + 8) * 4, 4);
        a[r][0] = _mm512_add_epi16(a[r][0], _mm512_maddubs_epi16(lo, _mm512_set1_epi32(x0)));
        a[r][1] = _mm512_add_epi16(a[r][1], _mm512_maddubs_epi16(hi, _mm512_set1_epi32(x1)));
      }
    }
    const __m512i sz = _mm512_loadu_si512((const void*)(wg + 512));
    const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(sz)), 16));
    const __m512 ze = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(sz, 1)), 16));
    for (int r = 0; r < R; ++r) {
      const int32_t gs = gsum[r][g];
      const __m512i s = _mm512_add_epi32(_mm512_madd_epi16(a[r][0], one16), _mm512_madd_epi16(a[r][1], one16));
      const __m512i d = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * gs));
      f[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(d), f[r]);
      f[r] = _mm512_fmadd_ps(ze, _mm512_set1_ps((float)gs), f[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * BLK, f[r]);
}

// blocks4's twin without VNNI (same arguments, same results): passes of up to 4 rows over a block (more spill
// registers: 6 and 8 rows in one pass measured slower than in passes of 4 and 4, on a Zen 4), the block from cache
// after the first pass
__attribute__((target("avx512f,avx512bw,avx512vl")))
void blocks4_bw(const uint8_t* packed, const int8_t* xq, const int32_t* gsum, int64_t M, int64_t Kp, int64_t b0,
                int64_t b1, float* acc_all, int64_t Np) {
  constexpr int64_t RM = 4;
  const int64_t ng = Kp / G4;
  float acc[RM * BLK];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* w = packed + b * ng * GBYTES;
    for (int64_t m0 = 0; m0 < M; m0 += RM) {
      const int64_t R = std::min<int64_t>(M - m0, RM);
      const int8_t* rows[RM];
      const int32_t* gs[RM];
      for (int64_t r = 0; r < R; ++r) { rows[r] = xq + (m0 + r) * Kp; gs[r] = gsum + (m0 + r) * ng; }
      switch (R) {
        case 1: block4_rows_bw<1>(w, rows, gs, ng, acc); break;
        case 2: block4_rows_bw<2>(w, rows, gs, ng, acc); break;
        case 3: block4_rows_bw<3>(w, rows, gs, ng, acc); break;
        default: block4_rows_bw<4>(w, rows, gs, ng, acc); break;
      }
      for (int64_t r = 0; r < R; ++r) memcpy(acc_all + (m0 + r) * Np + b * BLK, acc + r * BLK, BLK * 4);
    }
  }
}

// ---- the W8A8 / W4A8 paths ("isa"): 2 AVX-512 VNNI, 3 AVX-512 without VNNI (AVX-512F/BW/VL), 1 AVX2 + FMA; 0 none.
// The numbers are names, not an order (3 came last): isa_rank orders them (1 < 3 < 2), isa_clamp never returns a
// path above the level's own (ttsx_isa). Every path gives the same bits.
constexpr int ISA_AVX2 = 1, ISA_VNNI = 2, ISA_BW = 3;
inline int isa_rank(int isa) { return isa == ISA_AVX2 ? 1 : isa == ISA_BW ? 2 : isa == ISA_VNNI ? 3 : 0; }
inline int isa_of_level(int l) { return l >= 3 ? ISA_VNNI : l == 2 ? ISA_BW : l == 1 ? ISA_AVX2 : 0; }
inline int isa_clamp(int isa) {   // a path asked for -> the one that runs (the level's own where above it or unknown)
  const int top = isa_of_level(level());
  return isa_rank(isa) >= 1 && isa_rank(isa) <= isa_rank(top) ? isa : top;
}
inline bool isa_ok(int isa) { return isa_rank(isa) >= 1 && isa_rank(isa) <= isa_rank(isa_of_level(level())); }

// the dispatch of every caller (ttsx_w8a8 / ttsx_w4a8 here, the fused step's matmuls)
inline void quantize_row_isa(int isa, const void* x, int is_bf16, int64_t K, int64_t Kp, int8_t* xq, float* amax,
                             int32_t* sum) {
  if (isa == ISA_AVX2) quantize_row_avx2(x, is_bf16, K, Kp, xq, amax, sum);
  else quantize_row(x, is_bf16, K, Kp, xq, amax, sum);   // AVX-512F/BW: VNNI and BW paths
}
inline void blocks_isa(int isa, const uint8_t* packed, const int8_t* xq, int64_t M, int64_t Kp, int64_t b0, int64_t b1,
                       int32_t* acc_all, int64_t Np) {
  if (isa == ISA_VNNI) blocks(packed, xq, M, Kp, b0, b1, acc_all, Np);
  else if (isa == ISA_BW) blocks_bw(packed, xq, M, Kp, b0, b1, acc_all, Np);
  else blocks_avx2(packed, xq, M, Kp, b0, b1, acc_all, Np);
}
inline void blocks4_isa(int isa, const uint8_t* packed, const int8_t* xq, const int32_t* gsum, int64_t M, int64_t Kp,
                        int64_t b0, int64_t b1, float* acc_all, int64_t Np) {
  if (isa == ISA_VNNI) blocks4(packed, xq, gsum, M, Kp, b0, b1, acc_all, Np);
  else if (isa == ISA_BW) blocks4_bw(packed, xq, gsum, M, Kp, b0, b1, acc_all, Np);
  else blocks4_avx2(packed, xq, gsum, M, Kp, b0, b1, acc_all, Np);
}
inline void finish_row_isa(int isa, const int32_t* acc, const float* facc, int32_t off, float am, const float* scale,
                           int64_t n0, int64_t n1, int is_bf16, void* y, int32_t* acc_out) {
  if (isa == ISA_AVX2) finish_row_any(acc, facc, off, am, scale, n0, n1, is_bf16, y, acc_out);
  else finish_row(acc, facc, off, am, scale, n0, n1, is_bf16, y, acc_out);   // vectorised, the same operations
}

// group sums of one quantised row (W4A8: gsum[g] = sum of xq over group g)
inline void group_sums(const int8_t* xr, int64_t ng, int32_t* gs) {
  for (int64_t g = 0; g < ng; ++g) {
    int32_t t = 0;
    for (int64_t k = 0; k < G4; ++k) t += xr[g * G4 + k];
    gs[g] = t;
  }
}

// ---- how one call shares its output blocks between torch's threads (ttsx_w8a8 / ttsx_w4a8 here, the fused step's
// split matmuls): SHARE_SPLIT, at::parallel_for's fixed parts (halves at two threads), or SHARE_CLAIM, chunks of
// units claimed from a counter, so that the thread on the faster (or less busy) vCPU does more and neither waits
// for the other's fixed half. A unit's results never depend on which thread computes it or in which chunk (exact
// integer sums, then one fp32 epilogue per output): both give the same bits. cpu_ext.py sets the mode
// (ttsx_set_share) from TTS_MATMUL_SHARE or from its trial on this machine (`choose_share`); split until then.
constexpr int SHARE_SPLIT = 0, SHARE_CLAIM = 1;
int g_share = SHARE_SPLIT;

// units per claim: about 8 claims per thread, at least 64 KB of weight each (the fused step's team claims the same)
inline int64_t claim_chunk(int64_t U, int64_t unit_bytes, int nt) {
  return std::max<int64_t>({1, (U + 8 * nt - 1) / (8 * nt), (64 * 1024 + unit_bytes - 1) / std::max<int64_t>(1, unit_bytes)});
}

// f(u0, u1) over units [0, U): split (grain as at::parallel_for's) or claimed. Claimed: thread t owns the t-th of
// nt equal parts and claims it front to back in chunks of claim_chunk units, then claims what is left of the other
// parts (from the next thread's on) the same way. A part's chunks are claimed in memory order, so each thread reads
// one continuous stream until it runs out of its own (claims scattered over the whole weight restarted the hardware
// prefetch at every chunk: 8 claims per thread measured 15-30 % slower than the split on a Zen 4; owned parts with
// stealing lose nothing there).
template <class F>
void share_units(int64_t U, int64_t grain, int64_t unit_bytes, const F& f) {
  const int nt = at::get_num_threads();
  if (g_share != SHARE_CLAIM || nt < 2 || U < 2 || at::in_parallel_region()) {
    at::parallel_for(0, U, grain, f);
    return;
  }
  const int64_t chunk = claim_chunk(U, unit_bytes, nt);
  if (chunk >= U) {   // one chunk: the caller alone, as at::parallel_for with a grain >= U
    f(0, U);
    return;
  }
  constexpr int MAXT = 64;
  const int parts = std::min(nt, MAXT);
  struct alignas(64) Part { std::atomic<int64_t> next; int64_t end; };
  Part part[MAXT];
  for (int t = 0; t < parts; ++t) {
    part[t].next.store(U * t / parts, std::memory_order_relaxed);
    part[t].end = U * (t + 1) / parts;
  }
  at::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int i = 0; i < parts; ++i) {
        Part& q = part[(t + i) % parts];
        for (int64_t u0 = q.next.fetch_add(chunk, std::memory_order_relaxed); u0 < q.end;
             u0 = q.next.fetch_add(chunk, std::memory_order_relaxed))
          f(u0, std::min(q.end, u0 + chunk));
      }
  });
}

}  // namespace

extern "C" {

int ttsx_version() { return 1; }

// How ttsx_w8a8 / ttsx_w4a8 (and the fused step's split matmuls) share work between threads: 0 split, 1 claimed
// chunks (share_units); returns the mode before. ttsx_claim_chunk: the units per claim for U units of unit_bytes.
int ttsx_set_share(int mode) {
  const int was = g_share;
  g_share = mode == SHARE_CLAIM ? SHARE_CLAIM : SHARE_SPLIT;
  return was;
}
int64_t ttsx_claim_chunk(int64_t U, int64_t unit_bytes, int nt) { return claim_chunk(U, unit_bytes, nt); }

// The CPU level (the comment at level_of_cpu): what cpuid says, what the kernels run at (TTS_CPU_ISA may lower it),
// and a setter (tests, cpu_ext.py: clamped to cpuid's; returns the level before)
int ttsx_cpu_level() { return level_of_cpu(); }
int ttsx_level() { return level(); }
int ttsx_set_level(int l) {
  const int was = level();
  g_level = std::max(0, std::min(l, level_of_cpu()));
  return was;
}

// The W8A8 / W4A8 kernels' path at the level: 2 AVX-512 VNNI, 3 AVX-512F/BW/VL without VNNI, 1 AVX2 + FMA, 0 none
// (isa_rank: 1 < 3 < 2)
int ttsx_isa() { return isa_of_level(level()); }
int ttsx_isa_clamp(int isa) { return isa_clamp(isa); }   // the path a call asking for `isa` runs at the level

int ttsx_supported() { return ttsx_isa() == 2; }

int64_t ttsx_packed_bytes(int64_t N, int64_t K) { return round_up(N, BLK) * round_up(K, KU); }

// q [N, K] int8 (row-major, rows `ldq` apart) -> packed (ttsx_packed_bytes(N, K) bytes)
void ttsx_pack(const int8_t* q, int64_t N, int64_t K, int64_t ldq, uint8_t* packed) {
  const int64_t Np = round_up(N, BLK), Kp = round_up(K, KU);
  for (int64_t n = 0; n < Np; ++n) {
    const int64_t b = n / BLK, r = n % BLK;
    for (int64_t k = 0; k < Kp; ++k) {
      const int v = (n < N && k < K) ? q[n * ldq + k] : 0;
      packed[((b * (Kp / 4) + k / 4) * BLK + r) * 4 + k % 4] = (uint8_t)(v + 128);
    }
  }
}

// packed -> q [N, K] int8 (the inverse of ttsx_pack)
void ttsx_unpack(const uint8_t* packed, int64_t N, int64_t K, int8_t* q) {
  const int64_t Kp = round_up(K, KU);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = n / BLK, r = n % BLK;
    for (int64_t k = 0; k < K; ++k) q[n * K + k] = (int8_t)((int)packed[((b * (Kp / 4) + k / 4) * BLK + r) * 4 + k % 4] - 128);
  }
}

// The fused layer: x [M, K] (fp32 or bf16, rows `ldx` elements apart), packed weights, scale127 [N] fp32 ->
// y [M, N] (x's dtype, contiguous). acc_out (or NULL): the exact int32 sums sum_k xq[m, k] * q[n, k], [M, N].
void ttsx_w8a8(const void* x, int is_bf16, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed,
               const float* scale127, int64_t N, void* y, int32_t* acc_out, int isa) {
  isa = isa_clamp(isa);   // never a path this CPU (or the forced level) lacks
  const int64_t Np = round_up(N, BLK), Kp = round_up(K, KU);
  const int64_t esz = is_bf16 ? 2 : 4;
  std::vector<int8_t> xq(M * Kp);
  std::vector<float> amax(M);
  std::vector<int32_t> xsum(M), acc(M * Np);
  for (int64_t m = 0; m < M; ++m) {
    quantize_row_isa(isa, (const char*)x + m * ldx * esz, is_bf16, K, Kp, xq.data() + m * Kp, &amax[m], &xsum[m]);
  }
  const int64_t nb = Np / BLK;
  const int64_t grain = std::max<int64_t>(1, (int64_t)(64 * 1024) / (BLK * Kp * std::max<int64_t>(1, M / 4)));
  int32_t* accp = acc.data();
  const int8_t* xqp = xq.data();
  share_units(nb, grain, BLK * Kp, [&](int64_t b0, int64_t b1) {
    blocks_isa(isa, packed, xqp, M, Kp, b0, b1, accp, Np);
    for (int64_t m = 0; m < M; ++m) {
      const int32_t off = 128 * xsum[m];
      const float am = amax[m];
      const int64_t n1 = std::min(N, b1 * BLK);
      void* ym = is_bf16 ? (void*)((uint16_t*)y + m * N) : (void*)((float*)y + m * N);
      finish_row_isa(isa, accp + m * Np, nullptr, off, am, scale127, b0 * BLK, n1, is_bf16, ym,
                     acc_out ? acc_out + m * N : nullptr);
    }
  });
}

int64_t ttsx_packed4_bytes(int64_t N, int64_t K) { return round_up(N, BLK) / BLK * (round_up(K, G4) / G4) * GBYTES; }

// q [N, K] (0..15 as uint8, row-major), scale_zero [K / 64, N, 2] bf16 (quant.Int4Linear's) -> packed4. K % 64 == 0
// is not required: columns past K are q = 8 with scale and zero of the last group (w = zero * 0 input: x is 0 there).
void ttsx_pack4(const uint8_t* q, const uint16_t* scale_zero, int64_t N, int64_t K, uint8_t* packed) {
  const int64_t Np = round_up(N, BLK), ng = round_up(K, G4) / G4;
  memset(packed, 0, ttsx_packed4_bytes(N, K));
  for (int64_t b = 0; b < Np / BLK; ++b)
    for (int64_t g = 0; g < ng; ++g) {
      uint8_t* wg = packed + (b * ng + g) * GBYTES;
      for (int64_t r = 0; r < BLK; ++r) {
        const int64_t n = b * BLK + r;
        for (int64_t kk = 0; kk < G4; ++kk) {
          const int64_t k = g * G4 + kk, step = kk / 4, j = kk % 4;
          const int v = (n < N && k < K) ? (q[n * K + k] & 15) : 8;
          uint8_t* byte = wg + (step % 8) * 64 + r * 4 + j;
          *byte |= step < 8 ? v : (v << 4);
        }
        uint16_t* sz = (uint16_t*)(wg + 512);
        sz[r] = n < N ? scale_zero[(g * N + n) * 2] : 0;
        sz[16 + r] = n < N ? scale_zero[(g * N + n) * 2 + 1] : 0;
      }
    }
}

// x [M, K] (fp32 or bf16) x packed4 -> y [M, N] (x's dtype); isa: 2 AVX-512 VNNI, 3 AVX-512 without VNNI, 1 AVX2
// (the same bits)
void ttsx_w4a8(const void* x, int is_bf16, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed, int64_t N,
               void* y, int isa) {
  isa = isa_clamp(isa);
  const int64_t Np = round_up(N, BLK), Kp = round_up(K, G4), ng = Kp / G4;
  const int64_t esz = is_bf16 ? 2 : 4;
  std::vector<int8_t> xq(M * Kp);
  std::vector<float> amax(M);
  std::vector<int32_t> xsum(M), gsum(M * ng);
  std::vector<float> acc(M * Np);
  for (int64_t m = 0; m < M; ++m) {
    const void* xm = (const char*)x + m * ldx * esz;
    quantize_row_isa(isa, xm, is_bf16, K, Kp, xq.data() + m * Kp, &amax[m], &xsum[m]);
    group_sums(xq.data() + m * Kp, ng, gsum.data() + m * ng);
  }
  float* accp = acc.data();
  const int64_t grain = std::max<int64_t>(1, (int64_t)(32 * 1024) / (ng * GBYTES * std::max<int64_t>(1, M / 4)));
  share_units(Np / BLK, grain, ng * GBYTES, [&](int64_t b0, int64_t b1) {
    blocks4_isa(isa, packed, xq.data(), gsum.data(), M, Kp, b0, b1, accp, Np);
    for (int64_t m = 0; m < M; ++m) {
      const float am = amax[m] * (1.0f / 127.0f);
      const int64_t n1 = std::min(N, b1 * BLK);
      void* ym = is_bf16 ? (void*)((uint16_t*)y + m * N) : (void*)((float*)y + m * N);
      finish_row_isa(isa, nullptr, accp + m * Np, 0, am, nullptr, b0 * BLK, n1, is_bf16, ym, nullptr);
    }
  });
}

// A plain read of n bytes (64-byte loads, split over torch's threads): the memory floor beside the kernels
// (python -m bench matmuls gbps). Returns a value that depends on every byte so the reads cannot be dropped.
int64_t ttsx_read(const uint8_t* p, int64_t n) {
  const int64_t chunk = 1 << 16, nc = n / chunk;
  std::vector<int64_t> part(std::max<int64_t>(1, nc), 0);
  at::parallel_for(0, nc, 4, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) part[c] = level() >= 2 ? read_chunk(p + c * chunk, chunk) : read_chunk_avx2(p + c * chunk, chunk);
  });
  int64_t s = 0;
  for (int64_t v : part) s ^= v;
  return s;
}

// ttsx_read with the chunks CLAIMED by the threads (an atomic counter, 1 MiB each) instead of split in fixed halves:
// a thread on a faster core reads more, so the pass takes (sum of the threads' rates) instead of (threads x the
// slowest's) when the vCPUs read at different rates (plain_read.py, docs/benchmarks.md "the plain read").
int64_t ttsx_read_claim(const uint8_t* p, int64_t n) {
  const int64_t chunk = 1 << 20, nc = n / chunk;
  std::vector<int64_t> part(std::max<int64_t>(1, nc), 0);
  std::atomic<int64_t> next{0};
  const int nt = at::get_num_threads();
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < nc; c = next.fetch_add(1))
      part[c] = level() >= 2 ? read_chunk(p + c * chunk, chunk) : read_chunk_avx2(p + c * chunk, chunk);
  });
  int64_t s = 0;
  for (int64_t v : part) s ^= v;
  return s;
}

}  // extern "C"

// ==================================================================================================================
// Codec decoder: fused SnakeBeta (tts_engine/codec/decoder.py SnakeBeta, fast path).
//   y = x + ib[c] * sin(x * a[c])^2  with a = exp(alpha), ib = 1 / (exp(beta) + 1e-9) precomputed in fp32.
// One pass instead of aten's five (mul, sin, pow, mul, add), computed in fp32, rounded once to x's dtype (fp32, or
// bf16 to nearest even). sin^2 has period pi, so u = x * a is reduced to r = u - pi * round(u / pi) in
// [-pi/2, pi/2] (pi split in three for the product) and sin(r) is its Taylor series to r^11 (|error| < 6e-8 there).
// Layouts: x [B, C, L] channel-major (each (b, c) a run of L elements, a/ib scalars for the run) or time-major
// (each (b, t) a run of C elements, a/ib vectors), in and out the same layout. AVX-512F, AVX2 + FMA, and scalar
// paths; split over rows with at::parallel_for.
// ==================================================================================================================
namespace {

constexpr float SNK_INV_PI = 0.318309886183790671f;
constexpr float SNK_P1 = 3.140625f, SNK_P2 = 9.67502593994140625e-4f, SNK_P3 = 1.509957990978376432e-7f;
constexpr float SNK_C3 = -1.66666666666666667e-1f, SNK_C5 = 8.33333333333333333e-3f,
                SNK_C7 = -1.98412698412698413e-4f, SNK_C9 = 2.75573192239858907e-6f,
                SNK_C11 = -2.50521083854417188e-8f;

inline float snake1(float x, float a, float ib) {
  const float u = x * a;
  const float n = nearbyintf(u * SNK_INV_PI);
  const float r = ((u - n * SNK_P1) - n * SNK_P2) - n * SNK_P3;
  const float r2 = r * r;
  const float s = r + r * r2 * (SNK_C3 + r2 * (SNK_C5 + r2 * (SNK_C7 + r2 * (SNK_C9 + r2 * SNK_C11))));
  return x + ib * (s * s);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
inline __m512 snake16(__m512 x, __m512 a, __m512 ib) {
  const __m512 u = _mm512_mul_ps(x, a);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(u, _mm512_set1_ps(SNK_INV_PI)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SNK_P1), u);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SNK_P2), r);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SNK_P3), r);
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 p = _mm512_fmadd_ps(r2, _mm512_set1_ps(SNK_C11), _mm512_set1_ps(SNK_C9));
  p = _mm512_fmadd_ps(r2, p, _mm512_set1_ps(SNK_C7));
  p = _mm512_fmadd_ps(r2, p, _mm512_set1_ps(SNK_C5));
  p = _mm512_fmadd_ps(r2, p, _mm512_set1_ps(SNK_C3));
  const __m512 s = _mm512_fmadd_ps(_mm512_mul_ps(r, r2), p, r);
  return _mm512_fmadd_ps(ib, _mm512_mul_ps(s, s), x);
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
void snake_run512(const void* x, void* y, int is_bf16, int64_t n, const float* a, const float* ib, int vec_params) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
    const __m512 av = vec_params ? _mm512_maskz_loadu_ps(m, a + i) : _mm512_set1_ps(*a);
    const __m512 bv = vec_params ? _mm512_maskz_loadu_ps(m, ib + i) : _mm512_set1_ps(*ib);
    const __m512 v = snake16(load16(x, is_bf16, i, m), av, bv);
    if (is_bf16) {
      __m512i u = _mm512_castps_si512(v);   // round to nearest even (finite values)
      u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                               _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
      _mm256_mask_storeu_epi16((uint16_t*)y + i, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    } else {
      _mm512_mask_storeu_ps((float*)y + i, m, v);
    }
  }
}

__attribute__((target("avx2,fma")))
void snake_run256(const void* x, void* y, int is_bf16, int64_t n, const float* a, const float* ib, int vec_params) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 av = vec_params ? _mm256_loadu_ps(a + i) : _mm256_set1_ps(*a);
    const __m256 bv = vec_params ? _mm256_loadu_ps(ib + i) : _mm256_set1_ps(*ib);
    __m256 xv;
    if (is_bf16) {
      const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
      xv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      xv = _mm256_loadu_ps((const float*)x + i);
    }
    const __m256 u = _mm256_mul_ps(xv, av);
    const __m256 nn = _mm256_round_ps(_mm256_mul_ps(u, _mm256_set1_ps(SNK_INV_PI)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(nn, _mm256_set1_ps(SNK_P1), u);
    r = _mm256_fnmadd_ps(nn, _mm256_set1_ps(SNK_P2), r);
    r = _mm256_fnmadd_ps(nn, _mm256_set1_ps(SNK_P3), r);
    const __m256 r2 = _mm256_mul_ps(r, r);
    __m256 p = _mm256_fmadd_ps(r2, _mm256_set1_ps(SNK_C11), _mm256_set1_ps(SNK_C9));
    p = _mm256_fmadd_ps(r2, p, _mm256_set1_ps(SNK_C7));
    p = _mm256_fmadd_ps(r2, p, _mm256_set1_ps(SNK_C5));
    p = _mm256_fmadd_ps(r2, p, _mm256_set1_ps(SNK_C3));
    const __m256 s = _mm256_fmadd_ps(_mm256_mul_ps(r, r2), p, r);
    const __m256 v = _mm256_fmadd_ps(bv, _mm256_mul_ps(s, s), xv);
    if (is_bf16) {
      __m256i u32 = _mm256_castps_si256(v);
      u32 = _mm256_add_epi32(u32, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                   _mm256_and_si256(_mm256_srli_epi32(u32, 16), _mm256_set1_epi32(1))));
      u32 = _mm256_srli_epi32(u32, 16);
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u32, u32), 0x08);
      _mm_storeu_si128((__m128i*)((uint16_t*)y + i), _mm256_castsi256_si128(packed));
    } else {
      _mm256_storeu_ps((float*)y + i, v);
    }
  }
  for (; i < n; ++i) {
    const float xi = is_bf16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
    const float v = snake1(xi, vec_params ? a[i] : *a, vec_params ? ib[i] : *ib);
    if (is_bf16) ((uint16_t*)y)[i] = f32_to_bf16(v);
    else ((float*)y)[i] = v;
  }
}

void snake_run1(const void* x, void* y, int is_bf16, int64_t n, const float* a, const float* ib, int vec_params) {
  for (int64_t i = 0; i < n; ++i) {
    const float xi = is_bf16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
    const float v = snake1(xi, vec_params ? a[i] : *a, vec_params ? ib[i] : *ib);
    if (is_bf16) ((uint16_t*)y)[i] = f32_to_bf16(v);
    else ((float*)y)[i] = v;
  }
}

}  // namespace

extern "C" {

// x, y: B*C*L elements of dtype (is_bf16 ? bf16 : fp32), same layout: time_major ? [B, L, C] : [B, C, L];
// a, ib: C floats. isa: 2 AVX-512F, 1 AVX2 + FMA, 0 scalar (the caller passes what this CPU has).
void ttsx_snake(const void* x, void* y, int is_bf16, int64_t B, int64_t C, int64_t L, int time_major,
                const float* a, const float* ib, int isa) {
  const int64_t rows = time_major ? B * L : B * C, run = time_major ? C : L;
  const int64_t esz = is_bf16 ? 2 : 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t)16384 / std::max<int64_t>(1, run));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const void* xr = (const char*)x + r * run * esz;
      void* yr = (char*)y + r * run * esz;
      const float* ar = time_major ? a : a + r % C;
      const float* br = time_major ? ib : ib + r % C;
      if (isa >= 2) snake_run512(xr, yr, is_bf16, run, ar, br, time_major);
      else if (isa == 1) snake_run256(xr, yr, is_bf16, run, ar, br, time_major);
      else snake_run1(xr, yr, is_bf16, run, ar, br, time_major);
    }
  });
}

namespace {
// The halves of ttsx_quant_u8 on [i0, i1): min/max (including 0), then quantise. Every path computes the same
// bits: min/max as `v < lo ? v : lo` / `v > hi ? v : hi` (MINPS/MAXPS with x first: a NaN input is passed over and
// -0 never replaces +0, so the order of the lanes does not matter), q = floor(clamp(fma(x, inv, zp + 0.5), 0, 255))
// with the clamp as `v > 0 ? v : 0` then `v < 255 ? v : 255` (a NaN gives 0).
inline float load1(const void* x, int is_bf16, int64_t i) {
  return is_bf16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
}

void minmax1(const void* x, int is_bf16, int64_t i0, int64_t i1, float* lo, float* hi) {
  float l = *lo, h = *hi;
  for (int64_t i = i0; i < i1; ++i) {
    const float v = load1(x, is_bf16, i);
    l = v < l ? v : l;
    h = v > h ? v : h;
  }
  *lo = l;
  *hi = h;
}

void quant1(const void* x, int is_bf16, int64_t i0, int64_t i1, float inv, float zp, uint8_t* q) {
  const float off = zp + 0.5f;
  for (int64_t i = i0; i < i1; ++i) {
    float v = std::fma(load1(x, is_bf16, i), inv, off);   // >= 0 up to rounding: floor(v) rounds half up
    v = v > 0.f ? v : 0.f;
    v = v < 255.f ? v : 255.f;
    q[i] = (uint8_t)(int)v;
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
void minmax512(const void* x, int is_bf16, int64_t i0, int64_t i1, float* lo, float* hi) {
  __m512 mn = _mm512_setzero_ps(), mx = _mm512_setzero_ps();
  for (int64_t i = i0; i < i1; i += 16) {
    const __mmask16 m = i1 - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (i1 - i)) - 1);
    const __m512 v = load16(x, is_bf16, i, m);   // masked lanes read 0 (inside [min(x, 0), max(x, 0)])
    mn = _mm512_min_ps(v, mn);
    mx = _mm512_max_ps(v, mx);
  }
  *lo = _mm512_reduce_min_ps(mn);
  *hi = _mm512_reduce_max_ps(mx);
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
void quant512(const void* x, int is_bf16, int64_t i0, int64_t i1, float inv, float zp, uint8_t* q) {
  const __m512 iv = _mm512_set1_ps(inv), off = _mm512_set1_ps(zp + 0.5f);
  const __m512 z = _mm512_setzero_ps(), top = _mm512_set1_ps(255.f);
  for (int64_t i = i0; i < i1; i += 16) {
    const __mmask16 m = i1 - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (i1 - i)) - 1);
    __m512 v = _mm512_fmadd_ps(load16(x, is_bf16, i, m), iv, off);
    v = _mm512_min_ps(_mm512_max_ps(v, z), top);
    const __m512i n = _mm512_cvttps_epi32(v);   // truncation of v >= 0: floor
    _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(n));
  }
}

// 8 elements (fp32 or bf16) from x + i as fp32
__attribute__((target("avx2,fma")))
inline __m256 load8(const void* x, int is_bf16, int64_t i) {
  if (is_bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps((const float*)x + i);
}

__attribute__((target("avx2,fma")))
void minmax256(const void* x, int is_bf16, int64_t i0, int64_t i1, float* lo, float* hi) {
  __m256 mn0 = _mm256_setzero_ps(), mx0 = _mm256_setzero_ps(), mn1 = mn0, mx1 = mx0;   // two chains each
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    const __m256 a = load8(x, is_bf16, i), b = load8(x, is_bf16, i + 8);
    mn0 = _mm256_min_ps(a, mn0);
    mx0 = _mm256_max_ps(a, mx0);
    mn1 = _mm256_min_ps(b, mn1);
    mx1 = _mm256_max_ps(b, mx1);
  }
  alignas(32) float l[8], h[8];
  _mm256_store_ps(l, _mm256_min_ps(mn1, mn0));
  _mm256_store_ps(h, _mm256_max_ps(mx1, mx0));
  float lo1 = 0.f, hi1 = 0.f;
  minmax1(l, 0, 0, 8, &lo1, &hi1);
  minmax1(h, 0, 0, 8, &lo1, &hi1);
  minmax1(x, is_bf16, i, i1, &lo1, &hi1);   // the tail
  *lo = lo1;
  *hi = hi1;
}

__attribute__((target("avx2,fma")))
void quant256(const void* x, int is_bf16, int64_t i0, int64_t i1, float inv, float zp, uint8_t* q) {
  const __m256 iv = _mm256_set1_ps(inv), off = _mm256_set1_ps(zp + 0.5f);
  const __m256 z = _mm256_setzero_ps(), top = _mm256_set1_ps(255.f);
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    __m256 a = _mm256_fmadd_ps(load8(x, is_bf16, i), iv, off);
    __m256 b = _mm256_fmadd_ps(load8(x, is_bf16, i + 8), iv, off);
    a = _mm256_min_ps(_mm256_max_ps(a, z), top);
    b = _mm256_min_ps(_mm256_max_ps(b, z), top);
    // truncation of v >= 0: floor; 0..255 in every 32-bit lane, so the saturating packs keep the values
    const __m256i w = _mm256_packus_epi32(_mm256_cvttps_epi32(a), _mm256_cvttps_epi32(b));   // a0-3 b0-3 a4-7 b4-7
    const __m128i u = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128((__m128i*)(q + i), _mm_shuffle_epi32(u, _MM_SHUFFLE(3, 1, 2, 0)));
  }
  quant1(x, is_bf16, i, i1, inv, zp, q);   // the tail
}
}  // namespace

// Dynamic per-tensor asymmetric uint8 quantisation of n dense values (bf16 or fp32) for the codec's int8
// convolutions (tts_engine/cpu/int8_conv.py): lo = min(x, 0), hi = max(x, 0), scale = (hi - lo) / 255 (1 when
// hi == lo), zp = round(-lo / scale); q = clamp(round(x / scale) + zp, 0, 255). Two passes (min/max, then
// quantise), split over threads with at::parallel_for. out[0] = scale, out[1] = zp (as float). isa: 2 the AVX-512
// loops, 1 the AVX2 ones, 0 the scalar ones (the same bits on every path).
void ttsx_quant_u8(const void* x, int is_bf16, int64_t n, uint8_t* q, float* out, int isa) {
  const int64_t grain = 1 << 16;
  const int64_t nchunks = std::max<int64_t>(1, (n + grain - 1) / grain);
  std::vector<float> mins(nchunks, 0.f), maxs(nchunks, 0.f);
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * grain, i1 = std::min(n, i0 + grain);
      float lo = 0.f, hi = 0.f;
      if (isa >= 2) minmax512(x, is_bf16, i0, i1, &lo, &hi);
      else if (isa == 1) minmax256(x, is_bf16, i0, i1, &lo, &hi);
      else minmax1(x, is_bf16, i0, i1, &lo, &hi);
      mins[c] = lo;
      maxs[c] = hi;
    }
  });
  float lo = 0.f, hi = 0.f;
  for (int64_t c = 0; c < nchunks; ++c) {
    lo = std::min(lo, mins[c]);
    hi = std::max(hi, maxs[c]);
  }
  float scale = (hi - lo) / 255.f;
  if (!(scale > 0.f) || !std::isfinite(scale)) scale = 1.f;
  const float zp = std::nearbyint(-lo / scale);
  const float inv = 1.f / scale;
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * grain, i1 = std::min(n, i0 + grain);
      if (isa >= 2) quant512(x, is_bf16, i0, i1, inv, zp, q);
      else if (isa == 1) quant256(x, is_bf16, i0, i1, inv, zp, q);
      else quant1(x, is_bf16, i0, i1, inv, zp, q);
    }
  });
  out[0] = scale;
  out[1] = zp;
}

int ttsx_snake_isa() { return level() >= 2 ? 2 : level(); }   // 2 AVX-512F, 1 AVX2 + FMA, 0 scalar

}  // extern "C"
// ==================================== end of the codec decoder section ===========================================
