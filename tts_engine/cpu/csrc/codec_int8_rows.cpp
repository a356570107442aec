// The codec's int8 convolutions on a whole batch in one oneDNN call, each row with its own activation scale and
// zero point (tts_engine/cpu/int8_conv.py, "batched"): the rows are quantised one by one (ttsx_quant_u8, the same
// bits as the row-by-row path), oneDNN sums the products of all rows in int32 with ONE zero point Z and gives them
// as fp32 (scales 1, no bias), and this epilogue finishes each row as oneDNN's own epilogue does for a row alone:
//   acc = F + (Z - zp_row) * sum_w[c]           (int32, exact; F is exact while |F| < 2^24, else the row is flagged)
//   v   = ((float)acc * scale_row) * w_scale[c] (+ bias[c])   two roundings, no fused multiply-add
//   y   = v in the output dtype (bf16: round to nearest even), then (+ add[c]: in fp32, rounded again)
// which is what the row-by-row path gives (`y + add` after oneDNN's bf16/fp32 output). A flagged row (|F| >= 2^24
// anywhere: its int32 sum did not survive fp32) is left to the caller, which decodes it row by row.
// Layouts: F, y and add are time-major, [rows][L][C] (channels-last [rows, C, 1, L]).
#pragma once   // one translation unit includes every source once (ttsx.cpp)
#include "cpu_ext.cpp"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")   // v = a * s * w + b must round after each operation, as oneDNN does

namespace {

constexpr float EXACT = 16777216.f;   // 2^24: every int32 below it in magnitude is exact in fp32

// one position (C channels) on the scalar path; returns false where some |F| >= 2^24
bool finish1(const float* f, int64_t C, int32_t dz, const int32_t* sumw, float s, const float* ws, const float* b,
             int is_bf16, const void* add, void* y) {
  bool ok = true;
  for (int64_t c = 0; c < C; ++c) {
    const float fv = f[c];
    const bool exact = std::fabs(fv) < EXACT;
    ok &= exact;
    const int32_t acc = (exact ? (int32_t)fv : 0) + dz * sumw[c];
    float v = (float)acc * s;
    v = v * ws[c];
    if (b) v = v + b[c];
    if (is_bf16) {
      uint16_t h = f32_to_bf16(v);
      if (add) h = f32_to_bf16(bf16_to_f32(h) + bf16_to_f32(((const uint16_t*)add)[c]));
      ((uint16_t*)y)[c] = h;
    } else {
      if (add) v = v + ((const float*)add)[c];
      ((float*)y)[c] = v;
    }
  }
  return ok;
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
bool finish512(const float* f, int64_t C, int32_t dz, const int32_t* sumw, float s, const float* ws, const float* b,
               int is_bf16, const void* add, void* y) {
  const __m512 vs = _mm512_set1_ps(s), lim = _mm512_set1_ps(EXACT);
  const __m512i vdz = _mm512_set1_epi32(dz);
  __mmask16 bad = 0;
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = C - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (C - c)) - 1);
    const __m512 fv = _mm512_maskz_loadu_ps(m, f + c);
    bad |= _mm512_mask_cmp_ps_mask(m, _mm512_abs_ps(fv), lim, _CMP_NLT_UQ);
    const __m512i acc = _mm512_add_epi32(_mm512_cvttps_epi32(fv),
                                         _mm512_mullo_epi32(vdz, _mm512_maskz_loadu_epi32(m, sumw + c)));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), vs);
    v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, ws + c));
    if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, b + c));
    if (is_bf16) {
      __m256i h = bf16_of(v);
      if (add) {
        const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        const __m512 av = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t*)add + c)), 16));
        h = bf16_of(_mm512_add_ps(hv, av));
      }
      _mm256_mask_storeu_epi16((uint16_t*)y + c, m, h);
    } else {
      if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, (const float*)add + c));
      _mm512_mask_storeu_ps((float*)y + c, m, v);
    }
  }
  return bad == 0;
}

}  // namespace

extern "C" {

// The rows of x ([rows][n] dense, bf16 or fp32) quantised each on its own, as ttsx_quant_u8 (q [rows][n],
// out[2r] = scale, out[2r+1] = zero point of row r).
void ttsc_quant_rows(const void* x, int is_bf16, int64_t rows, int64_t n, uint8_t* q, float* out, int isa) {
  const int64_t esz = is_bf16 ? 2 : 4;
  for (int64_t r = 0; r < rows; ++r)
    ttsx_quant_u8((const char*)x + r * n * esz, is_bf16, n, q + r * n, out + 2 * r, isa);
}

// The epilogue above for rows x L positions of C channels: dz[r] = Z - zp of row r, scale[r] its scale; sumw, ws,
// bias (or NULL) per channel; add (or NULL) and y in the output dtype. bad[r] = 1 where row r needs the row path.
// isa: 2 the AVX-512 loop, else the scalar one (the same bits).
void ttsc_int8_epilogue(const float* f, int64_t rows, int64_t L, int64_t C, const int32_t* dz, const float* scale,
                        const int32_t* sumw, const float* ws, const float* bias, int is_bf16, const void* add,
                        void* y, int32_t* bad, int isa) {
  const int64_t esz = is_bf16 ? 2 : 4;
  for (int64_t r = 0; r < rows; ++r) bad[r] = 0;
  at::parallel_for(0, rows * L, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / L;
      const void* a = add ? (const char*)add + p * C * esz : nullptr;
      void* out = (char*)y + p * C * esz;
      const bool ok = isa >= 2 ? finish512(f + p * C, C, dz[r], sumw, scale[r], ws, bias, is_bf16, a, out)
                               : finish1(f + p * C, C, dz[r], sumw, scale[r], ws, bias, is_bf16, a, out);
      if (!ok) bad[r] = 1;   // (only ever set to 1: a race between threads writes the same value)
    }
  });
}

}  // extern "C"

#pragma GCC pop_options
