// A fused decode step of a whole Qwen3 decoder stack on a CPU (part of the one library, ttsx.cpp;
// tts_engine/cpu/fused_step.py calls it through ctypes).
//
// One call runs every layer of a stack (the talker's 28, the code predictor's 5) and the final norm for M entries,
// entry e being one new position pos[e] of cache row row[e] (rows decode one position each; the code predictor's
// first pass gives two entries of the same row, positions 0 and 1: every layer writes all entries' keys before any
// entry attends, so the second sees the first, as the causal mask of the eager path). Per layer:
//   a = RMSNorm(h) * w_in;  qkv = a @ Wqkv (W8A8 or W4A8 through cpu_ext.cpp's block kernels; bf16: mm16_groups below
//   on the nn.Linear's own bf16 weight)
//   q, k per head: RMSNorm(.) * w_q / w_k, then rotate-half RoPE at pos[e]; k, v -> the static KV cache
//   o = softmax(q k^T / sqrt(hd)) v over the row's cache positions 0..pos[e] (fp32), query head j reads kv head j/g
//   h += o @ Wo;  a = RMSNorm(h) * w_post;  gu = a @ Wgu;  h += (silu(gate) * up) @ Wdown
// then out = RMSNorm(h) * w_final. The residual stream h and everything between the matmuls stay fp32 (the eager
// path rounds to the engine's dtype after each op: the two agree to bf16 rounding, tests/test_fused_step.py).
//
// The matmul kernels, the activation quantisation and the weight layouts are cpu_ext.cpp's own (included below, so
// this library is built from the same source as the layers' kernels and reads the same packed weights).
// Threads (g_team, fused_step.py team_setting): TEAM_OFF ("split", the default): each matmul splits its output
// blocks over torch's threads with at::parallel_for, like ttsx_w8a8; the attention of many cache positions splits its
// (entry, head) pairs the same way; the rest runs in the caller (run_stack). TEAM_CLAIM / TEAM_BARRIER: the whole
// stack in one parallel region (run_team, below). All give the same numbers bit for bit.
// Profile (ttsf_profile_set): per-stage times summed over calls (Stage); off, each stage costs one branch.
#pragma once   // one translation unit includes every source once (ttsx.cpp)
#include "cpu_ext.cpp"

#include <memory>
#include <omp.h>
#include <atomic>
#include <time.h>

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

// ---- profile (ttsf_profile_set(1) turns it on; off, each stage pays one predictable branch) -------------------
// Per stage, the nanoseconds summed over calls (the caller's thread, or thread 0 of a team). A matmul stage is its
// wall time from the activation rows ready to every thread's share done (so it includes the hand-offs and the wait
// for the slower thread); MM_BUSY_MAX / MM_BUSY_MIN sum, over matmuls, the busiest and the idlest thread's time in
// the kernel itself: (matmul walls - MM_BUSY_MAX) is the hand-off cost, (MAX - MIN) the imbalance.
enum Stage {
  P_IO,          // input to fp32, final norm, output store, scratch, and the rest outside the stages (fork/join)
  P_NORM_IN, P_QUANT, P_QKV, P_ROPE_CACHE, P_ATTN, P_O, P_RESID, P_NORM_POST, P_GU, P_SILU, P_DOWN,
  P_BUSY_MAX, P_BUSY_MIN, P_CALL, P_CALLS, P_MATMULS, NSTAGES
};
constexpr int MAX_THREADS = 256;
int g_prof = 0;
int g_team = 0;   // TeamMode (fused_step.py sets it from TTS_FUSED_TEAM)
int64_t g_acc[NSTAGES];
int64_t g_busy[MAX_THREADS];   // the split path: one matmul's kernel time per thread (a team: Sync::busy)

inline int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
// t0 <- now, and the time since the old t0 added to stage `st` (profile on only)
inline void lap(int st, int64_t& t0) {
  if (!g_prof) return;
  const int64_t t = now_ns();
  g_acc[st] += t - t0;
  t0 = t;
}
inline void busy_done(int nt) {   // one matmul's per-thread times -> BUSY_MAX / BUSY_MIN
  int64_t mx = 0, mn = INT64_MAX;
  for (int i = 0; i < nt; ++i) {
    mx = std::max(mx, g_busy[i]);
    mn = std::min(mn, g_busy[i]);
    g_busy[i] = 0;
  }
  g_acc[P_BUSY_MAX] += mx;
  g_acc[P_BUSY_MIN] += mn;
  g_acc[P_MATMULS] += 1;
}

// ---- scratch: born at the top of a call, sized for its M entries, dies with the call ---------------------------
// A matmul's activation rows, prepared once for all its output blocks (int8 rows, their amax and sums; bf16 rows)
struct Act {
  std::vector<int8_t> xq;
  std::vector<float> amax;
  std::vector<int32_t> xsum, gsum;
  std::vector<uint16_t> xb;   // bf16 weights: activation rows rounded to bf16 [M, Kmax] ...
  std::vector<float> xf;      // ... and the same values widened to fp32 (the paths without AVX-512 BF16)

  Act(const Plan& p, int64_t M) {
    const int64_t Kmax = round_up(std::max({p.D, p.H * p.hd, p.I}), G4);
    if (p.wbits == 16) {
      xb.resize(M * Kmax);
      xf.resize(M * Kmax);
      return;
    }
    xq.resize(M * Kmax);
    amax.resize(M);
    xsum.resize(M);
    gsum.resize(M * (Kmax / G4));
  }
};

struct Scratch {
  std::vector<float> h;     // [M, D] residual stream
  std::vector<float> a;     // [M, max(D, H hd)] normed input of a matmul / attention output
  std::vector<float> t;     // [M, D] a matmul's result before the residual add
  std::vector<float> qkv;   // [M, (H + 2 Hkv) hd]
  std::vector<float> gu;    // [M, 2 I]
  std::vector<float> act;   // [M, I]
  Act x;                    // the activation rows of the matmul at hand
  std::vector<int32_t> acc; // the matmuls' sums (sized for the widest N)
  std::vector<float> facc;

  Scratch(const Plan& p, int64_t M) : x(p, M) {
    const int64_t qkvN = (p.H + 2 * p.Hkv) * p.hd;
    const int64_t Nmax = round_up(std::max({qkvN, p.D, 2 * p.I}), BLK);
    h.resize(M * p.D);
    a.resize(M * std::max(p.D, p.H * p.hd));
    t.resize(M * p.D);
    qkv.resize(M * qkvN);
    gu.resize(M * 2 * p.I);
    act.resize(M * p.I);
    if (p.wbits == 8) acc.resize(M * Nmax);
    else if (p.wbits == 4) facc.resize(M * Nmax);
  }
};

// ---- small vector helpers (one row; compiled for AVX-512F, AVX2 and plain x86-64, the variant picked by the CPU
// level of cpu_ext.cpp, `level()`: cpuid's, or lower where TTS_CPU_ISA forces it, so a forced level runs no AVX-512
// code anywhere in the step). The body is written once (always inlined into each target's wrapper). ------------
#define TTSX_ISA_VARIANTS(RET, NAME, PARAMS, ARGS)                                                             \
  __attribute__((target("avx512f"))) RET NAME##_avx512 PARAMS { return NAME##_body ARGS; }                    \
  __attribute__((target("avx2"))) RET NAME##_avx2 PARAMS { return NAME##_body ARGS; }                         \
  RET NAME##_plain PARAMS { return NAME##_body ARGS; }                                                          \
  inline RET NAME PARAMS {                                                                                      \
    const int l_ = level();                                                                                     \
    return l_ >= 2 ? NAME##_avx512 ARGS : l_ >= 1 ? NAME##_avx2 ARGS : NAME##_plain ARGS;                       \
  }

__attribute__((always_inline)) inline void rms_norm_row_body(const float* x, const float* w, int64_t n, float eps,
                                                             float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}
TTSX_ISA_VARIANTS(void, rms_norm_row, (const float* x, const float* w, int64_t n, float eps, float* out),
                  (x, w, n, eps, out))

// RoPE's angles at `pos`: cs[i] = cos, cs[hd/2 + i] = sin of pos * inv_freq[i] (fp32, as layers.rope_cos_sin).
// They depend on the position only: rope_cache takes them once per entry for all its heads.
void rope_angles(int64_t hd, const float* inv_freq, int64_t pos, float* cs) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float f = (float)pos * inv_freq[i];
    cs[i] = std::cos(f);
    cs[half + i] = std::sin(f);
  }
}

// x[hd] <- x rotated by the angles cs (rotate-half: pairs (i, i + hd/2) share frequency inv_freq[i])
void rope_apply(float* x, int64_t hd, const float* cs) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c = cs[i], s = cs[half + i];
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
__attribute__((always_inline)) inline void attend_row_body(const float* q, const C* keys, const C* vals, int64_t S,
                                                           int64_t hd, float scale, float* scores, float* out) {
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
template <class C>
__attribute__((target("avx512f"))) void attend_row_avx512(const float* q, const C* keys, const C* vals, int64_t S,
                                                          int64_t hd, float scale, float* scores, float* out) {
  attend_row_body<C>(q, keys, vals, S, hd, scale, scores, out);
}
template <class C>
__attribute__((target("avx2"))) void attend_row_avx2(const float* q, const C* keys, const C* vals, int64_t S,
                                                     int64_t hd, float scale, float* scores, float* out) {
  attend_row_body<C>(q, keys, vals, S, hd, scale, scores, out);
}
template <class C>
void attend_row_plain(const float* q, const C* keys, const C* vals, int64_t S, int64_t hd, float scale, float* scores,
                      float* out) {
  attend_row_body<C>(q, keys, vals, S, hd, scale, scores, out);
}
template <class C>
inline void attend_row(const float* q, const C* keys, const C* vals, int64_t S, int64_t hd, float scale, float* scores,
                       float* out) {
  const int l = level();
  if (l >= 2) attend_row_avx512<C>(q, keys, vals, S, hd, scale, scores, out);
  else if (l >= 1) attend_row_avx2<C>(q, keys, vals, S, hd, scale, scores, out);
  else attend_row_plain<C>(q, keys, vals, S, hd, scale, scores, out);
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

// ---- one matmul, in three parts: the activation rows (prep), the output units (blocks of BLK rows; bf16: groups
// of R4) and a range of units (mm_range, any thread; its outputs and sums only) --------------------------------
// Row quantisation as cpu_ext's layers (kernels.quantize_rows); int32 sums (W8A8) or per-group float sums (W4A8)
// from cpu_ext.cpp's block kernels; the scale applied per output, as ttsx_w8a8 / ttsx_w4a8 do. bf16: the activations
// rounded to bf16 (and widened back for the paths without AVX-512 BF16), products and sums in fp32.
void prep(const Plan& p, int64_t K, const float* x, int64_t M, Act& a) {
  if (p.wbits == 16) {
    for (int64_t i = 0; i < M * K; ++i) {
      a.xb[i] = f32_to_bf16(x[i]);
      a.xf[i] = bf16_to_f32(a.xb[i]);
    }
    return;
  }
  if (p.wbits == 8) {
    const int64_t Kp = round_up(K, KU);
    for (int64_t m = 0; m < M; ++m) {
      quantize_row_isa((int)p.isa, x + m * K, 0, K, Kp, a.xq.data() + m * Kp, &a.amax[m], &a.xsum[m]);
    }
    return;
  }
  const int64_t Kp = round_up(K, G4), ng = Kp / G4;
  for (int64_t m = 0; m < M; ++m) {
    int8_t* xr = a.xq.data() + m * Kp;
    quantize_row_isa((int)p.isa, x + m * K, 0, K, Kp, xr, &a.amax[m], &a.xsum[m]);
    group_sums(xr, ng, a.gsum.data() + m * ng);
  }
}

inline int64_t units(const Plan& p, const Lin& l) { return p.wbits == 16 ? l.N / R4 : round_up(l.N, BLK) / BLK; }

// the split's grain (units): as ttsx_w8a8 / ttsx_w4a8 / the bf16 path always had
inline int64_t grain_of(const Plan& p, const Lin& l, int64_t M) {
  if (p.wbits == 16) return std::max<int64_t>(1, (int64_t)(64 * 1024) / (R4 * l.K * 2));
  if (p.wbits == 8)
    return std::max<int64_t>(1, (int64_t)(64 * 1024) / (BLK * round_up(l.K, KU) * std::max<int64_t>(1, M / 4)));
  return std::max<int64_t>(1, (int64_t)(32 * 1024) / (round_up(l.K, G4) / G4 * GBYTES * std::max<int64_t>(1, M / 4)));
}

// units [b0, b1) of y[M, N] (fp32, rows N apart); acc / facc: [M, round_up(N, BLK)] sums (W8A8 / W4A8)
void mm_range(const Plan& p, const Lin& l, const Act& a, int64_t M, int64_t b0, int64_t b1, float* y, int32_t* acc,
              float* facc) {
  const int64_t N = l.N, K = l.K, Np = round_up(N, BLK);
  if (p.wbits == 16) return mm16_groups((int)p.isa, (const uint16_t*)l.w, K, a.xb.data(), a.xf.data(), M, b0, b1, y, N);
  const int64_t n1 = std::min(N, b1 * BLK);
  if (p.wbits == 8) {
    const int64_t Kp = round_up(K, KU);
    blocks_isa((int)p.isa, l.w, a.xq.data(), M, Kp, b0, b1, acc, Np);
    for (int64_t m = 0; m < M; ++m) {
      const int32_t off = 128 * a.xsum[m];
      const float am = a.amax[m];
      finish_row_isa((int)p.isa, acc + m * Np, nullptr, off, am, l.scale127, b0 * BLK, n1, 0, y + m * N, nullptr);
    }
    return;
  }
  blocks4_isa((int)p.isa, l.w, a.xq.data(), a.gsum.data(), M, round_up(K, G4), b0, b1, facc, Np);
  for (int64_t m = 0; m < M; ++m) {
    const float am = a.amax[m] * (1.0f / 127.0f);
    finish_row_isa((int)p.isa, nullptr, facc + m * Np, 0, am, nullptr, b0 * BLK, n1, 0, y + m * N, nullptr);
  }
}

// bytes of weight per unit (a block of BLK output rows; bf16: a group of R4)
inline int64_t unit_bytes_of(const Plan& p, const Lin& l) {
  return p.wbits == 16 ? R4 * l.K * 2 : p.wbits == 8 ? BLK * round_up(l.K, KU) : round_up(l.K, G4) / G4 * GBYTES;
}

// y[M, N] = x[M, K] @ W^T, the units shared over torch's threads as cpu_ext.cpp's share_units says (split with
// at::parallel_for, or claimed chunks: the same bits); `st`: its profile stage
void linear(const Plan& p, const Lin& l, const float* x, int64_t M, float* y, Scratch& s, int st, int64_t& t0) {
  prep(p, l.K, x, M, s.x);
  lap(P_QUANT, t0);
  share_units(units(p, l), grain_of(p, l, M), unit_bytes_of(p, l), [&](int64_t b0, int64_t b1) {
    const int64_t b = g_prof ? now_ns() : 0;
    mm_range(p, l, s.x, M, b0, b1, y, s.acc.data(), s.facc.data());
    if (g_prof) g_busy[std::min(at::get_thread_num(), MAX_THREADS - 1)] += now_ns() - b;
  });
  lap(st, t0);
  if (g_prof) busy_done(at::get_num_threads());
}

// ---- attention of one layer -------------------------------------------------------------------------------------
// qkv [M, (H + 2 Hkv) hd] -> q, k normed per head and rotated; every entry's k, v written to its (row, pos) of
// layer l of the cache; then out [M, H hd] = attention of each entry's q heads over its row's positions 0..pos.
// Both parts take a range of kv heads [j0, j1) (and the q heads that read them), so that a team of threads can split
// a layer's heads without waiting on each other between the cache write and the attention.
template <class C>
void rope_cache(const Plan& p, int64_t l, const Cache& c, const int64_t* row, const int64_t* pos, int64_t M,
                float* qkv_all, int64_t j0, int64_t j1) {
  const int64_t H = p.H, Hkv = p.Hkv, hd = p.hd, W = (H + 2 * Hkv) * hd, g = H / Hkv;
  const float* qn = p.ptr<float>(l, Q_NORM);
  const float* kn = p.ptr<float>(l, K_NORM);
  C* kl = (C*)c.k + l * c.layer_stride;
  C* vl = (C*)c.v + l * c.layer_stride;
  std::vector<float> cs(hd);
  int64_t cs_pos = -1;
  for (int64_t e = 0; e < M; ++e) {
    float* qkv = qkv_all + e * W;
    if (pos[e] != cs_pos) {   // the angles of this entry's position (entries of one position share them)
      rope_angles(hd, p.inv_freq, pos[e], cs.data());
      cs_pos = pos[e];
    }
    for (int64_t j = j0 * g; j < j1 * g; ++j) {   // q heads: normed in place, then rotated
      float* x = qkv + j * hd;
      rms_norm_row(x, qn, hd, p.eps, x);
      rope_apply(x, hd, cs.data());
    }
    for (int64_t j = j0; j < j1; ++j) {           // k heads, the same; k and v to the cache
      float* x = qkv + (H + j) * hd;
      rms_norm_row(x, kn, hd, p.eps, x);
      rope_apply(x, hd, cs.data());
      const int64_t at = row[e] * c.row_stride + j * c.head_stride + pos[e] * hd;
      store_row<C>(kl + at, x, hd);
      store_row<C>(vl + at, qkv + (H + Hkv + j) * hd, hd);
    }
  }
}

inline int64_t max_len_of(const int64_t* pos, int64_t M) {
  int64_t smax = 1;
  for (int64_t e = 0; e < M; ++e) smax = std::max(smax, pos[e] + 1);
  return smax;
}

// (entry, q head) pairs [i0, i1) (i = e H + j); scores: [max pos + 1]
template <class C>
void attend(const Plan& p, int64_t l, const Cache& c, const int64_t* row, const int64_t* pos, const float* qkv_all,
            int64_t i0, int64_t i1, float* scores, float* out) {
  const int64_t H = p.H, Hkv = p.Hkv, hd = p.hd, W = (H + 2 * Hkv) * hd, g = H / Hkv;
  const C* kl = (const C*)c.k + l * c.layer_stride;
  const C* vl = (const C*)c.v + l * c.layer_stride;
  const float scale = 1.0f / std::sqrt((float)hd);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t e = i / H, j = i % H;
    const int64_t base = row[e] * c.row_stride + (j / g) * c.head_stride;
    attend_row<C>(qkv_all + e * W + j * hd, kl + base, vl + base, pos[e] + 1, hd, scale, scores, out + e * H * hd + j * hd);
  }
}

template <class C>
void attention(const Plan& p, int64_t l, const Cache& c, const int64_t* row, const int64_t* pos, int64_t M,
               Scratch& s, int64_t& t0) {
  rope_cache<C>(p, l, c, row, pos, M, s.qkv.data(), 0, p.Hkv);
  lap(P_ROPE_CACHE, t0);
  const int64_t smax = max_len_of(pos, M);
  const int64_t grain = std::max<int64_t>(1, (int64_t)(64 * 1024) / (smax * p.hd));
  at::parallel_for(0, M * p.H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(smax);   // per task: one (entry, head)'s scores at a time
    attend<C>(p, l, c, row, pos, s.qkv.data(), i0, i1, scores.data(), s.a.data());
  });
  lap(P_ATTN, t0);
}

// silu(gate) * up with exp(x) computed in fp32 without a library call, 16 (AVX-512F) or 8 (AVX2) lanes at a time
// (std::exp per element took ~5-7 ms of a 4-row W4A8 predictor frame at one thread; gcc does not vectorise it):
// x = n ln2 + r (n = x log2(e) rounded to nearest even, ln2 in two parts, |r| <= ln2 / 2), e^r by its Taylor
// series to r^8 (truncation < 0.1 ulp), times 2^n built in the exponent bits; x clamped to [-87, 88] (2^n stays
// normal; gate / (1 + e^-gate) is gate or ~0 there, and a NaN gate stays NaN). Within 1 ulp of expf over the range;
// the vector and scalar lanes run the same operations (no FMA), so every path gives the same bits.
constexpr float EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_C[9] = {2.48015873e-5f, 1.98412698e-4f, 1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f,
                            1.66666667e-1f, 0.5f, 1.0f, 1.0f};

inline float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = std::nearbyint(x * EXP_LOG2E);
  const float r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO;
  float p = EXP_C[0];
  for (int k = 1; k < 9; ++k) p = p * r + EXP_C[k];
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}

inline void silu_tail(const float* gate, const float* up, int64_t i, int64_t I, float* out) {
  for (; i < I; ++i) out[i] = gate[i] / (1.0f + exp_poly(-gate[i])) * up[i];
}

__attribute__((target("avx512f")))
void silu_mul_avx512(const float* gu, int64_t M, int64_t I, float* act) {
  for (int64_t e = 0; e < M; ++e) {
    const float* gate = gu + e * 2 * I;
    const float* up = gate + I;
    float* out = act + e * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
      const __m512 g = _mm512_loadu_ps(gate + i);
      __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), g);
      x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
      const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_HI))),
                                     _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_LO)));
      __m512 p = _mm512_set1_ps(EXP_C[0]);
      for (int k = 1; k < 9; ++k) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_C[k]));
      const __m512 scale = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
      const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(p, scale));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, den), _mm512_loadu_ps(up + i)));
    }
    silu_tail(gate, up, i, I, out);
  }
}

__attribute__((target("avx2")))
void silu_mul_avx2(const float* gu, int64_t M, int64_t I, float* act) {
  for (int64_t e = 0; e < M; ++e) {
    const float* gate = gu + e * 2 * I;
    const float* up = gate + I;
    float* out = act + e * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      __m256 x = _mm256_sub_ps(_mm256_setzero_ps(), g);
      x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
      const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI))),
                                     _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)));
      __m256 p = _mm256_set1_ps(EXP_C[0]);
      for (int k = 1; k < 9; ++k) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_C[k]));
      const __m256 scale = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
      const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(p, scale));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, den), _mm256_loadu_ps(up + i)));
    }
    silu_tail(gate, up, i, I, out);
  }
}

inline void silu_mul(const float* gu, int64_t M, int64_t I, float* act) {
  const int l = level();
  if (l >= 2) return silu_mul_avx512(gu, M, I, act);
  if (l >= 1) return silu_mul_avx2(gu, M, I, act);
  for (int64_t e = 0; e < M; ++e) silu_tail(gu + e * 2 * I, gu + e * 2 * I + I, 0, I, act + e * I);
}

// The stack, each matmul split over torch's threads with at::parallel_for, the rest in the caller.
template <class C>
void run_stack(const Plan& p, const Cache& c, const int64_t* row, const int64_t* pos, int64_t M, Scratch& s) {
  const int64_t D = p.D, I = p.I, Hhd = p.H * p.hd, qkvN = (p.H + 2 * p.Hkv) * p.hd;
  int64_t t0 = g_prof ? now_ns() : 0;
  for (int64_t l = 0; l < p.L; ++l) {
    for (int64_t e = 0; e < M; ++e) rms_norm_row(&s.h[e * D], p.ptr<float>(l, IN_NORM), D, p.eps, &s.a[e * D]);
    lap(P_NORM_IN, t0);
    linear(p, p.lin(l, QKV_W, QKV_S, qkvN, D), s.a.data(), M, s.qkv.data(), s, P_QKV, t0);
    attention<C>(p, l, c, row, pos, M, s, t0);
    linear(p, p.lin(l, O_W, O_S, D, Hhd), s.a.data(), M, s.t.data(), s, P_O, t0);
    for (int64_t i = 0; i < M * D; ++i) s.h[i] += s.t[i];
    lap(P_RESID, t0);
    for (int64_t e = 0; e < M; ++e) rms_norm_row(&s.h[e * D], p.ptr<float>(l, POST_NORM), D, p.eps, &s.a[e * D]);
    lap(P_NORM_POST, t0);
    linear(p, p.lin(l, GU_W, GU_S, 2 * I, D), s.a.data(), M, s.gu.data(), s, P_GU, t0);
    silu_mul(s.gu.data(), M, I, s.act.data());
    lap(P_SILU, t0);
    linear(p, p.lin(l, DOWN_W, DOWN_S, D, I), s.act.data(), M, s.t.data(), s, P_DOWN, t0);
    for (int64_t i = 0; i < M * D; ++i) s.h[i] += s.t[i];
    lap(P_RESID, t0);
  }
}

// ---- the stack in one parallel region (a "team"): no fork/join per matmul ------------------------------------------
// Every thread of the team keeps its own copy of the residual stream and computes the norms, the activation rows of
// every matmul and silu(gate) * up itself (the same operations in the same order: the copies stay identical, and the
// results equal run_stack's bit for bit). The shared work of a layer comes in 5 stages: each matmul's output units
// and the attention's kv heads (rope, cache write and the attention of the q heads that read them: no thread waits
// between the cache write and the attention). Only the stages' outputs are shared. Two ways to split a stage:
//   TEAM_CLAIM: threads claim chunks of units from a counter (each chunk a contiguous part of the weight)
//     and a stage is over when all its units are done, not when all threads have arrived: a thread that the OS
//     took away (a busy machine) holds back at most the chunk it is in, and the others do its share; a wait spins
//     a bounded time (g_spin) and then sleeps 20 us between looks.
//   TEAM_BARRIER: a fixed split (thread t streams the t-th contiguous part) and an OpenMP barrier after each stage.
enum TeamMode { TEAM_OFF = 0, TEAM_BARRIER = 1, TEAM_CLAIM = 2 };
// a wait past its spin sleeps in short naps: the core goes to whoever the OS has waiting (on a busy machine, likely
// the very thread this one waits for), where sched_yield would keep it busy
inline void nap() {
  timespec t{0, 20000};
  nanosleep(&t, nullptr);
}
int g_spin = 4096;   // g_spin: pauses a wait spins before it yields (or drops a thread left behind)

struct Shared {   // written by the team's shares, read by all once a stage is done
  std::vector<float> qkv, ao, t, gu;
  std::vector<int32_t> acc;
  std::vector<float> facc;
  Shared(const Plan& p, int64_t M) {
    const int64_t qkvN = (p.H + 2 * p.Hkv) * p.hd;
    const int64_t Nmax = round_up(std::max({qkvN, p.D, 2 * p.I}), BLK);
    qkv.resize(M * qkvN);
    ao.resize(M * p.H * p.hd);
    t.resize(M * p.D);
    gu.resize(M * 2 * p.I);
    if (p.wbits == 8) acc.resize(M * Nmax);
    else if (p.wbits == 4) facc.resize(M * Nmax);
  }
};

inline void share(int64_t n, int tid, int nt, int64_t& a, int64_t& b) {
  a = n * tid / nt;
  b = n * (tid + 1) / nt;
}

// The stages of one call: their claim and done counters, and (profile) each thread's busy time in each
// TEAM_CLAIM: a thread may run ahead of another by whole stages, so a shared output is rewritten (the next
// layer's) only once every thread has read the last one: each read of a shared output that every thread makes (a
// "consume point": the attention output into o_proj's rows, o_proj's and down's outputs into the residual, gate_up's
// into silu) is numbered, and `progress` holds each thread's last one done (and whether it is reading one now). A
// writer waits for the others' progress (guard); one that stays behind for g_spin looks (the OS took it away)
// is dropped: its progress becomes DROPPED, it sees that at its next consume point and leaves the stack to the
// others (thread 0, whose residual is the call's result, is never dropped: the call waits for it anyway).
struct Sync {
  static constexpr int64_t DROPPED = -1;
  int mode, nt;
  int64_t stages;
  int64_t attn_every = 0;   // a stack's stages: 5 per layer, the second the attention (profile only)
  std::unique_ptr<std::atomic<int64_t>[]> next, done;
  std::unique_ptr<std::atomic<int64_t>[]> progress;   // [nt]: 2 (last consume point done + 1) + reading, or DROPPED
  std::vector<int64_t> busy;   // [stages, nt] ns (profile on only)
  Sync(int mode, int nt, int64_t stages) : mode(mode), nt(nt), stages(stages), next(new std::atomic<int64_t>[stages]),
                                           done(new std::atomic<int64_t>[stages]),
                                           progress(new std::atomic<int64_t>[nt]) {
    for (int64_t k = 0; k < stages; ++k) {
      next[k].store(0, std::memory_order_relaxed);
      done[k].store(0, std::memory_order_relaxed);
    }
    for (int i = 0; i < nt; ++i) progress[i].store(0, std::memory_order_relaxed);
    if (g_prof) busy.assign(stages * nt, 0);
  }
  // consume point cp (0, 1, ...): false if this thread was dropped (it must leave the stack then)
  bool consume_begin(int tid, int64_t cp) {
    if (mode != TEAM_CLAIM) return true;
    int64_t idle = 2 * cp;   // idle after cp - 1
    return progress[tid].compare_exchange_strong(idle, 2 * (cp + 1) + 1, std::memory_order_acq_rel);
  }
  void consume_end(int tid, int64_t cp) {
    if (mode == TEAM_CLAIM) progress[tid].store(2 * (cp + 1), std::memory_order_release);
  }
  // before writing a shared output: every other thread has passed consume point cp (the last read of what is
  // overwritten), or is dropped
  void guard(int tid, int64_t cp) {
    if (mode != TEAM_CLAIM || cp < 0) return;
    for (int i = 0; i < nt; ++i) {
      if (i == tid) continue;
      for (int spins = 0;; ++spins) {
        int64_t v = progress[i].load(std::memory_order_acquire);
        if (v == DROPPED) break;
        const int64_t c = v / 2 - 1;                      // idle (v even): done with c; reading (odd): reading c
        if (v % 2 == 0 ? c >= cp : c > cp) break;         // done with cp
        if (v % 2 == 1 && c == cp) {                      // reading cp right now: it is running, wait
          _mm_pause();
          continue;
        }
        if (spins < g_spin || i == 0) {
          if (spins < g_spin) _mm_pause();
          else nap();
          continue;
        }
        if (progress[i].compare_exchange_strong(v, DROPPED, std::memory_order_acq_rel)) break;
      }
    }
  }
  // stage k of U units: work(u0, u1) on this thread's units; returns once all U are done (their outputs visible)
  template <class F>
  void run(int64_t k, int tid, int64_t U, int64_t chunk, F&& work) {
    if (mode == TEAM_BARRIER) {
      const int64_t t0 = g_prof ? now_ns() : 0;
      int64_t b0, b1;
      share(U, tid, nt, b0, b1);
      if (b1 > b0) work(b0, b1);
      if (g_prof) busy[k * nt + tid] = now_ns() - t0;
#pragma omp barrier
      return;
    }
    int64_t spent = 0;
    for (;;) {
      const int64_t u0 = next[k].fetch_add(chunk, std::memory_order_relaxed);
      if (u0 >= U) break;
      const int64_t u1 = std::min(U, u0 + chunk);
      const int64_t w0 = g_prof ? now_ns() : 0;
      work(u0, u1);
      if (g_prof) spent += now_ns() - w0;
      done[k].fetch_add(u1 - u0, std::memory_order_release);
    }
    if (g_prof) busy[k * nt + tid] = spent;   // its time in the work itself
    for (int spins = 0; done[k].load(std::memory_order_acquire) < U;) {
      if (spins < g_spin) {
        ++spins;
        _mm_pause();
      } else {
        nap();
      }
    }
  }
  void profile_done() {   // after the region: each stage's busiest and idlest thread -> BUSY_MAX / BUSY_MIN
    if (!g_prof) return;
    for (int64_t k = 0; k < stages; ++k) {
      if (attn_every && k % attn_every == 1) continue;   // the attention's stages: not a matmul's
      int64_t mx = 0, mn = INT64_MAX;
      for (int i = 0; i < nt; ++i) {
        mx = std::max(mx, busy[k * nt + i]);
        mn = std::min(mn, busy[k * nt + i]);
      }
      g_acc[P_BUSY_MAX] += mx;
      g_acc[P_BUSY_MIN] += mn;
    }
  }
};

// units per claim: about 8 claims per thread and stage, at least 64 KB of weight each
inline int64_t chunk_of(const Plan& p, const Lin& l, int64_t U, int nt) {
  return claim_chunk(U, unit_bytes_of(p, l), nt);
}

// k0, cp0: the call's first stage and consume point in `sy` (predictor_frame.cpp runs 15 stacks and their heads
// in one Sync); false if this thread was dropped (it must leave the region then)
template <class C>
bool team_member(const Plan& p, const Cache& c, const int64_t* row, const int64_t* pos, int64_t M, Shared& sh,
                 Sync& sy, float* h, int tid, int64_t k0 = 0, int64_t cp0 = 0) {
  const int64_t D = p.D, I = p.I, Hhd = p.H * p.hd, qkvN = (p.H + 2 * p.Hkv) * p.hd;
  const int nt = sy.nt;
  Act x(p, M);
  std::vector<float> a(M * std::max(D, Hhd)), act(M * I), scores(max_len_of(pos, M));
  const bool prof = g_prof && tid == 0;   // thread 0 times the stages; every thread its share of each
  int64_t t0 = prof ? now_ns() : 0;
  auto tlap = [&](int st) { if (prof) lap(st, t0); };
  int64_t k = k0;   // the stage
  // one matmul: guard (the last consume point of what y overwrites, or -1), activation rows (read_cp: the consume
  // point of reading a shared `in`, or -1); false if this thread was dropped
  auto mm = [&](const Lin& l, const float* in, float* y, int st, int64_t read_cp, int64_t guard_cp) -> bool {
    if (read_cp >= 0 && !sy.consume_begin(tid, read_cp)) return false;
    prep(p, l.K, in, M, x);
    if (read_cp >= 0) sy.consume_end(tid, read_cp);
    tlap(P_QUANT);
    const int64_t U = units(p, l);
    sy.guard(tid, guard_cp);
    sy.run(k++, tid, U, chunk_of(p, l, U, nt), [&](int64_t b0, int64_t b1) {
      mm_range(p, l, x, M, b0, b1, y, sh.acc.data(), sh.facc.data());
    });
    tlap(st);
    if (prof) g_acc[P_MATMULS] += 1;
    return true;
  };
  auto add = [&](const float* t, int64_t cp) -> bool {   // h += t (shared), consume point cp
    if (!sy.consume_begin(tid, cp)) return false;
    for (int64_t i = 0; i < M * D; ++i) h[i] += t[i];
    sy.consume_end(tid, cp);
    return true;
  };
  const int64_t g = p.H / p.Hkv;
  for (int64_t l = 0; l < p.L; ++l) {
    const int64_t cp = cp0 + 4 * l;   // this layer's consume points: cp ao -> o_proj, cp + 1 o_proj -> h,
                                // cp + 2 gate_up -> silu, cp + 3 down -> h
    for (int64_t e = 0; e < M; ++e) rms_norm_row(h + e * D, p.ptr<float>(l, IN_NORM), D, p.eps, &a[e * D]);
    tlap(P_NORM_IN);
    mm(p.lin(l, QKV_W, QKV_S, qkvN, D), a.data(), sh.qkv.data(), P_QKV, -1, -1);   // qkv: read only inside stages
    sy.guard(tid, cp - 4);
    sy.run(k++, tid, p.Hkv, 1, [&](int64_t j0, int64_t j1) {   // kv heads [j0, j1) and their q heads, every entry
      rope_cache<C>(p, l, c, row, pos, M, sh.qkv.data(), j0, j1);
      for (int64_t e = 0; e < M; ++e)
        attend<C>(p, l, c, row, pos, sh.qkv.data(), e * p.H + j0 * g, e * p.H + j1 * g, scores.data(), sh.ao.data());
    });
    tlap(P_ATTN);
    if (!mm(p.lin(l, O_W, O_S, D, Hhd), sh.ao.data(), sh.t.data(), P_O, cp, cp - 1)) return false;
    if (!add(sh.t.data(), cp + 1)) return false;
    tlap(P_RESID);
    for (int64_t e = 0; e < M; ++e) rms_norm_row(h + e * D, p.ptr<float>(l, POST_NORM), D, p.eps, &a[e * D]);
    tlap(P_NORM_POST);
    mm(p.lin(l, GU_W, GU_S, 2 * I, D), a.data(), sh.gu.data(), P_GU, -1, cp - 2);
    if (!sy.consume_begin(tid, cp + 2)) return false;
    silu_mul(sh.gu.data(), M, I, act.data());
    sy.consume_end(tid, cp + 2);
    tlap(P_SILU);
    mm(p.lin(l, DOWN_W, DOWN_S, D, I), act.data(), sh.t.data(), P_DOWN, -1, cp + 1);
    if (!add(sh.t.data(), cp + 3)) return false;
    tlap(P_RESID);
  }
  return true;
}

template <class C>
void run_team(const Plan& p, const Cache& c, const int64_t* row, const int64_t* pos, int64_t M, float* h, int nt,
              int mode) {
  Shared sh(p, M);
  Sync sy(mode, nt, p.L * 5);
  sy.attn_every = 5;
  bool short_team = false;
  const std::vector<float> h0(h, h + M * p.D);   // the input, for the other threads' copies (thread 0 may be at work
                                                  // on h before another thread has started)
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    if (omp_get_num_threads() != nt) {   // fewer threads than asked (nested, a limit): the caller alone below
#pragma omp atomic write
      short_team = true;
    } else {
      // thread 0 works on the caller's h; the others on their own copies (identical all along)
      std::vector<float> own(tid ? M * p.D : 0);
      if (tid) memcpy(own.data(), h0.data(), M * p.D * 4);
      team_member<C>(p, c, row, pos, M, sh, sy, tid ? own.data() : h, tid);
    }
  }
  if (short_team) {
    Sync one(mode, 1, p.L * 5);
    one.attn_every = 5;
    team_member<C>(p, c, row, pos, M, sh, one, h, 0);
    one.profile_done();
    return;
  }
  sy.profile_done();
}

// ---- the matmuls alone (benchmarks: python -m bench fused_profile) -------------------------------------------
// Every layer's four matmuls in the stack's order on one fixed activation row set, nothing between them: split as
// run_stack (team = 0) or run_team (team = 1) splits them, with the same hand-offs, so the profile tells the kernel
// time (BUSY_MAX), the hand-offs and the gaps that the rest of a step adds.
void matmuls_only(const Plan& p, int64_t M, int team, int nt) {
  const int64_t D = p.D, I = p.I, Hhd = p.H * p.hd, qkvN = (p.H + 2 * p.Hkv) * p.hd;
  const int64_t Kmax = std::max({D, Hhd, I});
  std::vector<float> x(M * Kmax);
  for (int64_t i = 0; i < M * Kmax; ++i) x[i] = 0.01f * (float)((i * 7919) % 201 - 100);
  auto layer_lins = [&](int64_t l, Lin* out, int* st) {
    out[0] = p.lin(l, QKV_W, QKV_S, qkvN, D); st[0] = P_QKV;
    out[1] = p.lin(l, O_W, O_S, D, Hhd); st[1] = P_O;
    out[2] = p.lin(l, GU_W, GU_S, 2 * I, D); st[2] = P_GU;
    out[3] = p.lin(l, DOWN_W, DOWN_S, D, I); st[3] = P_DOWN;
  };
  if (!team) {
    Scratch s(p, M);
    int64_t t0 = g_prof ? now_ns() : 0;
    for (int64_t l = 0; l < p.L; ++l) {
      Lin ls[4]; int st[4];
      layer_lins(l, ls, st);
      float* ys[4] = {s.qkv.data(), s.t.data(), s.gu.data(), s.t.data()};
      for (int j = 0; j < 4; ++j) linear(p, ls[j], x.data(), M, ys[j], s, st[j], t0);
    }
    return;
  }
  Shared sh(p, M);
  Sync sy(team, nt, p.L * 4);
#pragma omp parallel num_threads(nt)
  if (omp_get_num_threads() == nt) {
    const int tid = omp_get_thread_num();
    Act a(p, M);
    const bool prof = g_prof && tid == 0;
    int64_t t0 = prof ? now_ns() : 0;
    int64_t k = 0;
    for (int64_t l = 0; l < p.L; ++l) {
      Lin ls[4]; int st[4];
      layer_lins(l, ls, st);
      float* ys[4] = {sh.qkv.data(), sh.t.data(), sh.gu.data(), sh.t.data()};
      for (int j = 0; j < 4; ++j) {
        prep(p, ls[j].K, x.data(), M, a);
        if (prof) lap(P_QUANT, t0);
        const int64_t U = units(p, ls[j]);
        sy.run(k++, tid, U, chunk_of(p, ls[j], U, nt), [&](int64_t b0, int64_t b1) {
          mm_range(p, ls[j], a, M, b0, b1, ys[j], sh.acc.data(), sh.facc.data());
        });
        if (prof) {
          lap(st[j], t0);
          g_acc[P_MATMULS] += 1;
        }
      }
    }
  }
  sy.profile_done();
}

}  // namespace fstep

extern "C" {

int ttsf_version() { return 2; }

// 2 / 1: run each call's stack in one parallel region (run_team; 2 claims chunks, 1 splits fixed with barriers),
// 0: one at::parallel_for per matmul (run_stack). Returns the setting before.
int ttsf_set_team(int on) {
  const int was = fstep::g_team;
  fstep::g_team = on;
  return was;
}

// The profile: on (1) / off (0); returns the setting before. ttsf_profile_read copies the NSTAGES sums (ns; the
// last two are counts) into out, zeroes them and returns NSTAGES.
int ttsf_profile_set(int on) {
  const int was = fstep::g_prof;
  fstep::g_prof = on;
  return was;
}

// The matmuls of a stack alone (fstep::matmuls_only), M activation rows, `reps` times over.
int ttsf_matmuls(const int64_t* dims, const int64_t* layers, int64_t M, int64_t reps, int team) {
  fstep::Plan p{dims[fstep::L_], dims[fstep::D_], dims[fstep::H_], dims[fstep::HKV_], dims[fstep::HD_],
                dims[fstep::I_], dims[fstep::WBITS_], dims[fstep::ISA_], 1e-6f, layers, nullptr, nullptr};
  if (M < 1 || (p.wbits != 8 && p.wbits != 4 && p.wbits != 16)) return -1;
  const int nt = std::min(at::get_num_threads(), fstep::MAX_THREADS);
  for (int64_t r = 0; r < reps; ++r) {
    const int64_t c0 = fstep::g_prof ? fstep::now_ns() : 0;
    fstep::matmuls_only(p, M, nt > 1 && !omp_in_parallel() ? team : 0, nt);
    if (fstep::g_prof) {
      fstep::g_acc[fstep::P_CALL] += fstep::now_ns() - c0;
      fstep::g_acc[fstep::P_CALLS] += 1;
    }
  }
  return 0;
}

// The pauses a team's wait spins before it yields the core or drops a thread left behind (tests: 0 drops any
// thread found behind at once). Returns the setting before.
int ttsf_set_spin(int pauses) {
  const int was = fstep::g_spin;
  fstep::g_spin = pauses;
  return was;
}

int ttsf_profile_read(int64_t* out) {
  for (int i = 0; i < fstep::NSTAGES; ++i) {
    out[i] = fstep::g_acc[i];
    fstep::g_acc[i] = 0;
  }
  return fstep::NSTAGES;
}

int ttsf_layer_fields() { return fstep::LAYER_FIELDS; }

// The bf16 matmul path this CPU runs (Dim ISA_ for wbits 16): 3 AVX-512 BF16, 2 AVX-512F, 1 AVX2 + FMA, 0 none
int ttsf_bf16_isa() {   // from cpu_ext.cpp's CPU level (cpuid's, or lower where TTS_CPU_ISA forces it)
  const int l = level();
  return l >= 4 ? 3 : l >= 2 ? 2 : l;
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
      ((p.wbits == 8 || p.wbits == 4) && !isa_ok((int)p.isa)))
    return -1;
  if (p.wbits == 16 && (p.isa < 1 || p.isa > ttsf_bf16_isa() || p.D % 32 || (p.H * p.hd) % 32 || p.I % 32 ||
                        ((p.H + 2 * p.Hkv) * p.hd) % fstep::R4))
    return -1;
  for (int64_t e = 0; e < M; ++e)
    if (pos[e] < 0 || pos[e] >= c.max_len) return -2;
  const int64_t call0 = fstep::g_prof ? fstep::now_ns() : 0;
  int64_t t0 = call0;
  const int64_t D = p.D;
  const int nt = std::min(at::get_num_threads(), fstep::MAX_THREADS);
  const int team = nt > 1 && !omp_in_parallel() ? fstep::g_team : 0;
  std::unique_ptr<fstep::Scratch> s;
  std::vector<float> hv;
  if (!team) s.reset(new fstep::Scratch(p, M));
  else hv.resize(M * D);
  float* h = team ? hv.data() : s->h.data();
  for (int64_t i = 0; i < M * D; ++i)
    h[i] = x_is_bf16 ? fstep::bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
  fstep::lap(fstep::P_IO, t0);
  int64_t staged = 0;   // the stage sums before the stack: what the stages do not cover goes to P_IO
  for (int i = fstep::P_NORM_IN; i <= fstep::P_DOWN; ++i) staged -= fstep::g_acc[i];
  if (team) {
    if (cache_is_bf16) fstep::run_team<uint16_t>(p, c, row, pos, M, h, nt, team);
    else fstep::run_team<float>(p, c, row, pos, M, h, nt, team);
  } else {
    if (cache_is_bf16) fstep::run_stack<uint16_t>(p, c, row, pos, M, *s);
    else fstep::run_stack<float>(p, c, row, pos, M, *s);
  }
  if (fstep::g_prof) {   // the stack's time outside its stages (a team's fork and join) -> P_IO
    const int64_t t = fstep::now_ns();
    for (int i = fstep::P_NORM_IN; i <= fstep::P_DOWN; ++i) staged += fstep::g_acc[i];
    fstep::g_acc[fstep::P_IO] += std::max<int64_t>(0, (t - t0) - staged);
    t0 = t;
  }
  std::vector<float> out(D);
  for (int64_t e = 0; e < M; ++e) {
    fstep::rms_norm_row(h + e * D, final_norm, D, p.eps, out.data());
    if (x_is_bf16) fstep::store_row<uint16_t>((uint16_t*)x + e * D, out.data(), D);
    else fstep::store_row<float>((float*)x + e * D, out.data(), D);
  }
  if (fstep::g_prof) {
    s.reset();
    fstep::lap(fstep::P_IO, t0);
    fstep::g_acc[fstep::P_CALL] += fstep::now_ns() - call0;
    fstep::g_acc[fstep::P_CALLS] += 1;
  }
  return 0;
}

}  // extern "C"
