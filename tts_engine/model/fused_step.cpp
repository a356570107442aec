// A fused decode step of a whole Qwen3 decoder stack on a CPU (tts_engine/model/fused_step.py builds this file with
// g++ on first use, as cpu_ext.py builds cpu_ext.cpp, and calls it through ctypes).
//
// One call runs every layer of a stack (the talker's 28, the code predictor's 5) and the final norm for M entries,
// entry e being one new position pos[e] of cache row row[e] (rows decode one position each; the code predictor's
// first pass gives two entries of the same row, positions 0 and 1: every layer writes all entries' keys before any
// entry attends, so the second sees the first, as the causal mask of the eager path). Per layer:
//   a = RMSNorm(h) * w_in;  qkv = a @ Wqkv (W8A8 or W4A8 through cpu_ext.cpp's block kernels; bf16: linear16 below
//   on the nn.Linear's own bf16 weight)
//   q, k per head: RMSNorm(.) * w_q / w_k, then rotate-half RoPE at pos[e]; k, v -> the static KV cache
//   o = softmax(q k^T / sqrt(hd)) v over the row's cache positions 0..pos[e] (fp32), query head j reads kv head j/g
//   h += o @ Wo;  a = RMSNorm(h) * w_post;  gu = a @ Wgu;  h += (silu(gate) * up) @ Wdown
// then out = RMSNorm(h) * w_final. The residual stream h and everything between the matmuls stay fp32 (the eager
// path rounds to the engine's dtype after each op: the two agree to bf16 rounding, tests/test_fused_step.py).
//
// The matmul kernels, the activation quantisation and the weight layouts are cpu_ext.cpp's own (included below, so
// this library is built from the same source as the layers' kernels and reads the same packed weights).
// Threads: each matmul splits its output blocks over torch's threads with at::parallel_for, like ttsx_w8a8; the
// attention of many cache positions splits its (entry, head) pairs the same way; the rest runs in the caller.
#include "cpu_ext.cpp"

#include <memory>

namespace fstep {

// ---- the plan (fused_step.py writes it; every pointer stays alive in the Python plan object) -------------------
// Per layer, LAYER_FIELDS int64 values (pointers as integers):
enum LayerField {
  IN_NORM = 0,    // fp32 [D]
  QKV_W, QKV_S,   // packed weight (cpu_ext.pack or pack4), fp32 scale127 [N] (W8A8; 0 for W4A8);
                  // bf16: the nn.Linear's own bf16 weight [N, K] row-major, 0
  Q_NORM, K_NORM, // fp32 [hd]
  O_W, O_S,
  POST_NORM,      // fp32 [D]
  GU_W, GU_S,
  DOWN_W, DOWN_S,
  LAYER_FIELDS
};

// Dimensions, as int64 values in this order
enum Dim { L_, D_, H_, HKV_, HD_, I_, WBITS_, ISA_, DIMS };

struct Lin {           // one quantised linear layer: y[M, N] = x[M, K] @ W^T
  const uint8_t* w;
  const float* scale127;   // W8A8 only
  int64_t N, K;
};

struct Plan {
  int64_t L, D, H, Hkv, hd, I, wbits, isa;
  float eps;
  const int64_t* layers;   // [L, LAYER_FIELDS]
  const float* inv_freq;   // [hd / 2]
  const float* final_norm; // [D]

  const int64_t* field(int64_t l) const { return layers + l * LAYER_FIELDS; }
  template <class T> const T* ptr(int64_t l, LayerField f) const { return (const T*)(intptr_t)field(l)[f]; }
  Lin lin(int64_t l, LayerField w, LayerField s, int64_t N, int64_t K) const {
    return Lin{ptr<uint8_t>(l, w), ptr<float>(l, s), N, K};
  }
};

// The KV cache of the stack: k, v [layers, rows, Hkv, max_len, hd] (layers.KVCache), fp32 or bf16; strides in elements
struct Cache {
  void* k;
  void* v;
  int64_t layer_stride, row_stride, head_stride, max_len;
  int is_bf16;
};

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---- scratch: born at the top of a call, sized for its M entries, dies with the call ---------------------------
struct Scratch {
  std::vector<float> h;     // [M, D] residual stream
  std::vector<float> a;     // [M, max(D, H hd)] normed input of a matmul / attention output
  std::vector<float> t;     // [M, D] a matmul's result before the residual add
  std::vector<float> qkv;   // [M, (H + 2 Hkv) hd]
  std::vector<float> gu;    // [M, 2 I]
  std::vector<float> act;   // [M, I]
  // the matmuls' activation rows and sums (sized for the widest K and N)
  std::vector<int8_t> xq;
  std::vector<float> amax;
  std::vector<int32_t> xsum, gsum, acc;
  std::vector<float> facc;
  std::vector<uint16_t> xb;   // bf16 weights: activation rows rounded to bf16 [M, Kmax] ...
  std::vector<float> xf;      // ... and the same values widened to fp32 (the paths without AVX-512 BF16)

  Scratch(const Plan& p, int64_t M) {
    const int64_t qkvN = (p.H + 2 * p.Hkv) * p.hd;
    const int64_t Kmax = round_up(std::max({p.D, p.H * p.hd, p.I}), G4);
    const int64_t Nmax = round_up(std::max({qkvN, p.D, 2 * p.I}), BLK);
    h.resize(M * p.D);
    a.resize(M * std::max(p.D, p.H * p.hd));
    t.resize(M * p.D);
    qkv.resize(M * qkvN);
    gu.resize(M * 2 * p.I);
    act.resize(M * p.I);
    if (p.wbits == 16) {
      xb.resize(M * Kmax);
      xf.resize(M * Kmax);
      return;
    }
    xq.resize(M * Kmax);
    amax.resize(M);
    xsum.resize(M);
    gsum.resize(M * (Kmax / G4));
    if (p.wbits == 8) acc.resize(M * Nmax);
    else facc.resize(M * Nmax);
  }
};

// ---- small vector helpers (one row; compiled for AVX-512, AVX2 and plain x86-64, chosen at load by the CPU) ----
__attribute__((target_clones("avx512f", "avx2", "default")))
void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// x[hd] <- x rotated by RoPE at `pos` (rotate-half: pairs (i, i + hd/2) share frequency inv_freq[i])
void rope_row(float* x, int64_t hd, const float* inv_freq, int64_t pos) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float f = (float)pos * inv_freq[i];   // fp32, as layers.rope_cos_sin
    const float c = std::cos(f), s = std::sin(f);
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
}

template <class C>
inline void store_row(C* dst, const float* src, int64_t n);
template <>
inline void store_row<float>(float* dst, const float* src, int64_t n) { memcpy(dst, src, n * 4); }
template <>
inline void store_row<uint16_t>(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

// out[hd] = softmax_s(q . k_s * scale) weighted sum of v_s over s < S (keys/values rows hd apart); scores: [S]
template <class C>
__attribute__((target_clones("avx512f", "avx2", "default")))
void attend_row(const float* q, const C* keys, const C* vals, int64_t S, int64_t hd, float scale, float* scores,
                float* out) {
  float mx = -INFINITY;
  for (int64_t s = 0; s < S; ++s) {
    const C* k = keys + s * hd;
    float d = 0.f;
#pragma omp simd reduction(+ : d)
    for (int64_t i = 0; i < hd; ++i) d += q[i] * load(k, i);
    scores[s] = d * scale;
    mx = std::max(mx, scores[s]);
  }
  float sum = 0.f;
  for (int64_t s = 0; s < S; ++s) {
    scores[s] = std::exp(scores[s] - mx);
    sum += scores[s];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
  for (int64_t s = 0; s < S; ++s) {
    const C* v = vals + s * hd;
    const float p = scores[s] * inv;
#pragma omp simd
    for (int64_t i = 0; i < hd; ++i) out[i] += p * load(v, i);
  }
}

// ---- one bf16 matmul: y[M, N] (fp32) = bf16(x[M, K]) @ W^T, W the layer's own bf16 weight [N, K] row-major -------
// Read in place (no packed copy). The activations are rounded to bf16 as the eager bf16 path's are; products and
// sums in fp32. Output rows go in groups of R4 over the threads. Within a group a tile takes RW weight rows at a
// time against MT activation rows (up to MAXR16 = 8: every weight block is read once for all of them), U
// independent sums per (weight row, activation row) over k: per step RW weight vectors and MT activation vectors
// are loaded for RW x MT x U products. At 1-2 rows RW is 1 (one sequential stream: two rows read side by side
// measured half the bandwidth on a Zen 4); at 3-8 rows the (L1-resident) activations' loads bound the speed, and
// RW is 2 with the next tile's rows prefetched in memory order, so the memory still sees one stream (Zen 4, one
// thread, weights over 300 MB: 10-14 % faster at 3, 4 and 8 rows than one weight row at a time). AVX2 (16
// registers) keeps RW 1 and passes of at most 4 rows. More than 8 activation rows take passes of 8 over a group
// (its rows then come again from L1/L2). K must be a multiple of 32 (the plan checks it). ISA (Dim ISA_ for
// wbits 16): 3 AVX-512 BF16 (vdpbf16ps), 2 AVX-512F (bf16 widened to fp32, FMA), 1 AVX2 + FMA.
constexpr int64_t R4 = 8;       // weight rows per group (a unit of the threads' split)
constexpr int MAXR16 = 8;       // activation rows per pass over a group

// the tile shapes: RW weight rows x MT activation rows x U sums (AVX-512: at most 16 accumulators of 32 registers)
template <int MT> constexpr int rw16() { return MT <= 2 ? 1 : 2; }
template <int MT> constexpr int u16() { return MT <= 2 ? 4 : (MT <= 4 ? 2 : 1); }
template <int MT> constexpr int u16_avx2() { return MT <= 2 ? 4 : 2; }   // RW 1, MT <= 4: <= 8 sums

template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void mm16_tile_bf16(const uint16_t* W, int64_t K, const uint16_t* xb, int64_t n, int64_t m0, float* y, int64_t N) {
  constexpr int RW = rw16<MT>(), U = u16<MT>();
  const uint16_t* x0 = xb + m0 * K;
  for (int64_t r = 0; r < R4; r += RW) {
    const uint16_t* w0 = W + (n + r) * K;
    __m512 acc[RW][MT][U];
    for (int j = 0; j < RW; ++j)
      for (int i = 0; i < MT; ++i)
        for (int u = 0; u < U; ++u) acc[j][i][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U) {
      __m512bh w[RW][U];
      if (RW > 1)   // the next tile's rows, in memory order: the weights reach the core as one stream
        for (int u = 0; u < RW * U; ++u) _mm_prefetch((const char*)(w0 + RW * K + RW * k + 32 * u), _MM_HINT_T0);
      for (int j = 0; j < RW; ++j)
        for (int u = 0; u < U; ++u) w[j][u] = (__m512bh)_mm512_loadu_si512(w0 + j * K + k + 32 * u);
      for (int i = 0; i < MT; ++i)
        for (int u = 0; u < U; ++u) {
          const __m512bh a = (__m512bh)_mm512_loadu_si512(x0 + i * K + k + 32 * u);
          for (int j = 0; j < RW; ++j) acc[j][i][u] = _mm512_dpbf16_ps(acc[j][i][u], a, w[j][u]);
        }
    }
    for (; k < K; k += 32) {
      __m512bh w[RW];
      for (int j = 0; j < RW; ++j) w[j] = (__m512bh)_mm512_loadu_si512(w0 + j * K + k);
      for (int i = 0; i < MT; ++i) {
        const __m512bh a = (__m512bh)_mm512_loadu_si512(x0 + i * K + k);
        for (int j = 0; j < RW; ++j) acc[j][i][0] = _mm512_dpbf16_ps(acc[j][i][0], a, w[j]);
      }
    }
    for (int j = 0; j < RW; ++j)
      for (int i = 0; i < MT; ++i) {
        __m512 s = acc[j][i][0];
        for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[j][i][u]);
        y[(m0 + i) * N + n + r + j] = _mm512_reduce_add_ps(s);
      }
  }
}

template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void mm16_tile_avx512(const uint16_t* W, int64_t K, const float* xf, int64_t n, int64_t m0, float* y, int64_t N) {
  constexpr int RW = rw16<MT>(), U = u16<MT>();
  const float* x0 = xf + m0 * K;
  for (int64_t r = 0; r < R4; r += RW) {
    const uint16_t* w0 = W + (n + r) * K;
    __m512 acc[RW][MT][U];
    for (int j = 0; j < RW; ++j)
      for (int i = 0; i < MT; ++i)
        for (int u = 0; u < U; ++u) acc[j][i][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U) {
      __m512 w[RW][U];
      if (RW > 1)   // as in mm16_tile_bf16 (16 bf16 per vector: a cache line every other one)
        for (int u = 0; u < RW * U; u += 2) _mm_prefetch((const char*)(w0 + RW * K + RW * k + 16 * u), _MM_HINT_T0);
      for (int j = 0; j < RW; ++j)
        for (int u = 0; u < U; ++u)
          w[j][u] = _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w0 + j * K + k + 16 * u))), 16));
      for (int i = 0; i < MT; ++i)
        for (int u = 0; u < U; ++u) {
          const __m512 a = _mm512_loadu_ps(x0 + i * K + k + 16 * u);
          for (int j = 0; j < RW; ++j) acc[j][i][u] = _mm512_fmadd_ps(a, w[j][u], acc[j][i][u]);
        }
    }
    for (; k < K; k += 16) {   // K a multiple of 32: whole steps of 16
      __m512 w[RW];
      for (int j = 0; j < RW; ++j)
        w[j] = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w0 + j * K + k))), 16));
      for (int i = 0; i < MT; ++i) {
        const __m512 a = _mm512_loadu_ps(x0 + i * K + k);
        for (int j = 0; j < RW; ++j) acc[j][i][0] = _mm512_fmadd_ps(a, w[j], acc[j][i][0]);
      }
    }
    for (int j = 0; j < RW; ++j)
      for (int i = 0; i < MT; ++i) {
        __m512 s = acc[j][i][0];
        for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[j][i][u]);
        y[(m0 + i) * N + n + r + j] = _mm512_reduce_add_ps(s);
      }
  }
}

template <int MT>
__attribute__((target("avx2,fma")))
void mm16_tile_avx2(const uint16_t* W, int64_t K, const float* xf, int64_t n, int64_t m0, float* y, int64_t N) {
  static_assert(MT <= 4, "AVX2: at most 4 rows per tile");
  constexpr int U = u16_avx2<MT>();   // one weight row at a time: MT x U <= 8 sums of 16 registers
  const float* x0 = xf + m0 * K;
  for (int64_t r = 0; r < R4; ++r) {
    const uint16_t* w0 = W + (n + r) * K;
    __m256 acc[MT][U];
    for (int i = 0; i < MT; ++i)
      for (int u = 0; u < U; ++u) acc[i][u] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8 * U) {   // K a multiple of 32, 8 U divides 32
      __m256 w[U];
      for (int u = 0; u < U; ++u)
        w[u] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w0 + k + 8 * u))), 16));
      for (int i = 0; i < MT; ++i)
        for (int u = 0; u < U; ++u) acc[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i * K + k + 8 * u), w[u], acc[i][u]);
    }
    for (int i = 0; i < MT; ++i) {
      __m256 a = acc[i][0];
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[i][u]);
      __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      v = _mm_add_ps(v, _mm_movehl_ps(v, v));
      v = _mm_add_ss(v, _mm_movehdup_ps(v));
      y[(m0 + i) * N + n + r] = _mm_cvtss_f32(v);
    }
  }
}

// one tile of mt (1..MAXR16) activation rows from m0 against the group's weight rows n..n+R4
template <int MT>
void mm16_tile(int isa, const uint16_t* W, int64_t K, const uint16_t* xb, const float* xf, int64_t n, int64_t m0,
               float* y, int64_t N) {
  if (isa == 3) mm16_tile_bf16<MT>(W, K, xb, n, m0, y, N);
  else if (isa == 2) mm16_tile_avx512<MT>(W, K, xf, n, m0, y, N);
  else if constexpr (MT <= 4) mm16_tile_avx2<MT>(W, K, xf, n, m0, y, N);
  else {   // AVX2: passes of at most 4 rows (8 rows at one sum each measured slower)
    mm16_tile_avx2<4>(W, K, xf, n, m0, y, N);
    mm16_tile_avx2<MT - 4>(W, K, xf, n, m0 + 4, y, N);
  }
}

// output rows [g0, g1) groups of R4, all M activation rows (passes of up to MAXR16 rows over each group)
void mm16_groups(int isa, const uint16_t* W, int64_t K, const uint16_t* xb, const float* xf, int64_t M, int64_t g0,
                 int64_t g1, float* y, int64_t N) {
  static_assert(MAXR16 == 8, "the switch below covers 1..8 rows");
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = g * R4;
    for (int64_t m = 0; m < M; m += MAXR16) {
      switch (std::min<int64_t>(MAXR16, M - m)) {
        case 1: mm16_tile<1>(isa, W, K, xb, xf, n, m, y, N); break;
        case 2: mm16_tile<2>(isa, W, K, xb, xf, n, m, y, N); break;
        case 3: mm16_tile<3>(isa, W, K, xb, xf, n, m, y, N); break;
        case 4: mm16_tile<4>(isa, W, K, xb, xf, n, m, y, N); break;
        case 5: mm16_tile<5>(isa, W, K, xb, xf, n, m, y, N); break;
        case 6: mm16_tile<6>(isa, W, K, xb, xf, n, m, y, N); break;
        case 7: mm16_tile<7>(isa, W, K, xb, xf, n, m, y, N); break;
        default: mm16_tile<8>(isa, W, K, xb, xf, n, m, y, N); break;
      }
    }
  }
}

// the activation rows to bf16 (xb) and back to fp32 (xf), then the groups split over torch's threads
void mm16(int isa, const uint16_t* W, int64_t N, int64_t K, const float* x, int64_t M, float* y, uint16_t* xb,
          float* xf) {
  for (int64_t i = 0; i < M * K; ++i) {
    xb[i] = f32_to_bf16(x[i]);
    xf[i] = bf16_to_f32(xb[i]);
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t)(64 * 1024) / (R4 * K * 2));
  at::parallel_for(0, N / R4, grain, [&](int64_t g0, int64_t g1) { mm16_groups(isa, W, K, xb, xf, M, g0, g1, y, N); });
}

void linear16(const Plan& p, const Lin& l, const float* x, int64_t M, float* y, Scratch& s) {
  mm16((int)p.isa, (const uint16_t*)l.w, l.N, l.K, x, M, y, s.xb.data(), s.xf.data());
}

// ---- one quantised matmul: y[M, N] (fp32, rows N apart) = x[M, K] (fp32, rows K apart) @ W^T ------------------
// Row quantisation as cpu_ext's layers (kernels.quantize_rows); int32 sums (W8A8) or per-group float sums (W4A8)
// from cpu_ext.cpp's block kernels; the scale applied per output, as ttsx_w8a8 / ttsx_w4a8 do.
void linear(const Plan& p, const Lin& l, const float* x, int64_t M, float* y, Scratch& s) {
  if (p.wbits == 16) return linear16(p, l, x, M, y, s);
  const int64_t N = l.N, K = l.K, Np = round_up(N, BLK);
  if (p.wbits == 8) {
    const int64_t Kp = round_up(K, KU);
    for (int64_t m = 0; m < M; ++m) {
      if (p.isa == 2) quantize_row(x + m * K, 0, K, Kp, s.xq.data() + m * Kp, &s.amax[m], &s.xsum[m]);
      else quantize_row_avx2(x + m * K, 0, K, Kp, s.xq.data() + m * Kp, &s.amax[m], &s.xsum[m]);
    }
    const int64_t grain = std::max<int64_t>(1, (int64_t)(64 * 1024) / (BLK * Kp * std::max<int64_t>(1, M / 4)));
    int32_t* acc = s.acc.data();
    const int8_t* xq = s.xq.data();
    at::parallel_for(0, Np / BLK, grain, [&](int64_t b0, int64_t b1) {
      if (p.isa == 2) blocks(l.w, xq, M, Kp, b0, b1, acc, Np);
      else blocks_avx2(l.w, xq, M, Kp, b0, b1, acc, Np);
      const int64_t n1 = std::min(N, b1 * BLK);
      for (int64_t m = 0; m < M; ++m) {
        const int32_t off = 128 * s.xsum[m];
        const float am = s.amax[m];
        if (p.isa == 2) {   // cpu_ext.cpp's vectorised epilogue, the same operations
          finish_row(acc + m * Np, nullptr, off, am, l.scale127, b0 * BLK, n1, 0, y + m * N, nullptr);
          continue;
        }
        for (int64_t n = b0 * BLK; n < n1; ++n) y[m * N + n] = (float)(acc[m * Np + n] - off) * (am * l.scale127[n]);
      }
    });
    return;
  }
  const int64_t Kp = round_up(K, G4), ng = Kp / G4;
  for (int64_t m = 0; m < M; ++m) {
    int8_t* xr = s.xq.data() + m * Kp;
    quantize_row(x + m * K, 0, K, Kp, xr, &s.amax[m], &s.xsum[m]);
    for (int64_t g = 0; g < ng; ++g) {
      int32_t t = 0;
      for (int64_t k = 0; k < G4; ++k) t += xr[g * G4 + k];
      s.gsum[m * ng + g] = t;
    }
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t)(32 * 1024) / (ng * GBYTES * std::max<int64_t>(1, M / 4)));
  float* acc = s.facc.data();
  at::parallel_for(0, Np / BLK, grain, [&](int64_t b0, int64_t b1) {
    blocks4(l.w, s.xq.data(), s.gsum.data(), M, Kp, b0, b1, acc, Np);
    const int64_t n1 = std::min(N, b1 * BLK);
    for (int64_t m = 0; m < M; ++m)
      finish_row(nullptr, acc + m * Np, 0, s.amax[m] * (1.0f / 127.0f), nullptr, b0 * BLK, n1, 0, y + m * N, nullptr);
  });
}

// ---- attention of one layer -------------------------------------------------------------------------------------
// s.qkv [M, (H + 2 Hkv) hd] -> q, k normed per head and rotated; every entry's k, v written to its (row, pos) of
// layer l of the cache; then s.a [M, H hd] = attention of each entry's q heads over its row's positions 0..pos.
template <class C>
void attention(const Plan& p, int64_t l, const Cache& c, const int64_t* row, const int64_t* pos, int64_t M,
               Scratch& s) {
  const int64_t H = p.H, Hkv = p.Hkv, hd = p.hd, W = (H + 2 * Hkv) * hd, g = H / Hkv;
  const float* qn = p.ptr<float>(l, Q_NORM);
  const float* kn = p.ptr<float>(l, K_NORM);
  C* kl = (C*)c.k + l * c.layer_stride;
  C* vl = (C*)c.v + l * c.layer_stride;
  for (int64_t e = 0; e < M; ++e) {
    float* qkv = s.qkv.data() + e * W;
    for (int64_t j = 0; j < H + Hkv; ++j) {   // q heads, then k heads: normed in place, then rotated
      float* x = qkv + j * hd;
      rms_norm_row(x, j < H ? qn : kn, hd, p.eps, x);
      rope_row(x, hd, p.inv_freq, pos[e]);
    }
    for (int64_t j = 0; j < Hkv; ++j) {
      const int64_t at = row[e] * c.row_stride + j * c.head_stride + pos[e] * hd;
      store_row<C>(kl + at, qkv + (H + j) * hd, hd);
      store_row<C>(vl + at, qkv + (H + Hkv + j) * hd, hd);
    }
  }
  int64_t smax = 1;
  for (int64_t e = 0; e < M; ++e) smax = std::max(smax, pos[e] + 1);
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t grain = std::max<int64_t>(1, (int64_t)(64 * 1024) / (smax * hd));
  at::parallel_for(0, M * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(smax);   // per task: one (entry, head)'s scores at a time
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / H, j = i % H;
      const int64_t base = row[e] * c.row_stride + (j / g) * c.head_stride;
      attend_row<C>(s.qkv.data() + e * W + j * hd, kl + base, vl + base, pos[e] + 1, hd, scale, scores.data(),
                    s.a.data() + e * H * hd + j * hd);
    }
  });
}

template <class C>
void run_stack(const Plan& p, const Cache& c, const int64_t* row, const int64_t* pos, int64_t M, Scratch& s) {
  const int64_t D = p.D, I = p.I, Hhd = p.H * p.hd, qkvN = (p.H + 2 * p.Hkv) * p.hd;
  for (int64_t l = 0; l < p.L; ++l) {
    for (int64_t e = 0; e < M; ++e) rms_norm_row(&s.h[e * D], p.ptr<float>(l, IN_NORM), D, p.eps, &s.a[e * D]);
    linear(p, p.lin(l, QKV_W, QKV_S, qkvN, D), s.a.data(), M, s.qkv.data(), s);
    attention<C>(p, l, c, row, pos, M, s);
    linear(p, p.lin(l, O_W, O_S, D, Hhd), s.a.data(), M, s.t.data(), s);
    for (int64_t i = 0; i < M * D; ++i) s.h[i] += s.t[i];
    for (int64_t e = 0; e < M; ++e) rms_norm_row(&s.h[e * D], p.ptr<float>(l, POST_NORM), D, p.eps, &s.a[e * D]);
    linear(p, p.lin(l, GU_W, GU_S, 2 * I, D), s.a.data(), M, s.gu.data(), s);
    for (int64_t e = 0; e < M; ++e)
      for (int64_t i = 0; i < I; ++i) {
        const float gt = s.gu[e * 2 * I + i], up = s.gu[e * 2 * I + I + i];
        s.act[e * I + i] = gt / (1.0f + std::exp(-gt)) * up;   // silu(gate) * up
      }
    linear(p, p.lin(l, DOWN_W, DOWN_S, D, I), s.act.data(), M, s.t.data(), s);
    for (int64_t i = 0; i < M * D; ++i) s.h[i] += s.t[i];
  }
}

}  // namespace fstep

extern "C" {

int ttsf_version() { return 1; }

int ttsf_layer_fields() { return fstep::LAYER_FIELDS; }

// The bf16 matmul path this CPU runs (Dim ISA_ for wbits 16): 3 AVX-512 BF16, 2 AVX-512F, 1 AVX2 + FMA, 0 none
int ttsf_bf16_isa() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return 3;
  if (avx512) return 2;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

// The bf16 matmul alone (tests and kernel timing): y[M, N] fp32 = bf16(x[M, K] fp32) @ W[N, K]^T on ISA path `isa`;
// 0, or -1 for shapes it does not take (N a multiple of R4, K of 32) or an ISA path this CPU lacks
int ttsf_mm16(const uint16_t* W, int64_t N, int64_t K, const float* x, int64_t M, float* y, int isa) {
  if (M < 1 || N < 1 || K < 32 || N % fstep::R4 || K % 32 || isa < 1 || isa > ttsf_bf16_isa()) return -1;
  std::vector<uint16_t> xb(M * K);
  std::vector<float> xf(M * K);
  fstep::mm16(isa, W, N, K, x, M, y, xb.data(), xf.data());
  return 0;
}

// x [M, D] (fp32 or bf16, contiguous): the stack's input at each entry -> overwritten by its normed output.
// dims: fstep::Dim values; layers [L, LAYER_FIELDS]; row, pos [M] int64: each entry's cache row and position;
// kc, vc: the cache's k and v (layers.KVCache), cache_strides: layer, row, head strides and max_len in elements.
// Returns 0, or a negative code for an input it refuses (nothing written then).
int ttsf_stack_step(const int64_t* dims, float eps, const int64_t* layers, const float* inv_freq,
                    const float* final_norm, void* x, int x_is_bf16, int64_t M, const int64_t* row,
                    const int64_t* pos, void* kc, void* vc, const int64_t* cache_strides, int cache_is_bf16) {
  fstep::Plan p{dims[fstep::L_], dims[fstep::D_], dims[fstep::H_], dims[fstep::HKV_], dims[fstep::HD_],
                dims[fstep::I_], dims[fstep::WBITS_], dims[fstep::ISA_], eps, layers, inv_freq, final_norm};
  fstep::Cache c{kc, vc, cache_strides[0], cache_strides[1], cache_strides[2], cache_strides[3], cache_is_bf16};
  if (M < 1 || p.hd % 2 || p.H % p.Hkv || (p.wbits != 8 && p.wbits != 4 && p.wbits != 16) ||
      (p.wbits == 4 && p.isa != 2))
    return -1;
  if (p.wbits == 16 && (p.isa < 1 || p.isa > 3 || p.D % 32 || (p.H * p.hd) % 32 || p.I % 32 ||
                        ((p.H + 2 * p.Hkv) * p.hd) % fstep::R4))
    return -1;
  for (int64_t e = 0; e < M; ++e)
    if (pos[e] < 0 || pos[e] >= c.max_len) return -2;
  fstep::Scratch s(p, M);
  const int64_t D = p.D;
  for (int64_t i = 0; i < M * D; ++i)
    s.h[i] = x_is_bf16 ? fstep::bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
  if (cache_is_bf16) fstep::run_stack<uint16_t>(p, c, row, pos, M, s);
  else fstep::run_stack<float>(p, c, row, pos, M, s);
  std::vector<float> out(D);
  for (int64_t e = 0; e < M; ++e) {
    fstep::rms_norm_row(&s.h[e * D], final_norm, D, p.eps, out.data());
    if (x_is_bf16) fstep::store_row<uint16_t>((uint16_t*)x + e * D, out.data(), D);
    else fstep::store_row<float>((float*)x + e * D, out.data(), D);
  }
  return 0;
}

}  // extern "C"
