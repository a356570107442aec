// The code predictor's whole frame in one call (part of the one library, ttsx.cpp; tts_engine/cpu/predictor_frame.py
// calls it through ctypes).
//
// For B rows (talker hidden h [B, Dt], codebook-0 id c0 [B]) one call runs the 15 passes that
// ModelRunner._predict_residuals runs from Python:
//   pass 0: entries [h, E0(c0)] at positions 0, 1 (E0: the talker's codec embedding); pass j > 0: Ej-1(c_j) at j + 1
//   (Ej: the predictor's codec_embedding[j]); each through small_to_mtp_projection (when it is not the identity),
//   the whole fused decoder stack (fused_step.cpp run_stack, the same kernels and cache writes as a FusedStep call),
//   the final norm, lm_head[j] (the stack's matmul kernel on the head's own packed weight), then codebook j + 1
//   chosen by exactly the rules of sampling.choose (see choose_row).
// Rounding as the Python loop over the fused stack: every tensor the loop hands from one aten call to the next (the
// stack's input and output, the head's logits) is rounded to the engine's activation dtype (bf16 or fp32) here too.
// What it uses of fused_step.cpp (keep in step when that file changes): fstep::Plan, Cache, Lin, Scratch (its vectors
// h, acc, facc and the activation rows x: xq, amax, xsum, gsum, xb, xf, grown here for the heads and the projection),
// linear() (with its profile stage), run_stack<C>(), rms_norm_row(), bf16_to_f32(), R4, and cpu_ext.cpp's
// f32_to_bf16, round_up, BLK, G4.
#pragma once   // one translation unit includes every source once (ttsx.cpp)
#include "fused_step.cpp"

namespace pframe {

using fstep::Cache;
using fstep::Lin;
using fstep::Plan;
using fstep::Scratch;

// ---- the counter-based uniforms of sampling.uniforms (splitmix64 finaliser, wrapping 64-bit arithmetic) ----------
inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;

inline uint64_t row_key(int64_t seed, int64_t frame, int64_t book) {
  return mix((uint64_t)seed * GOLDEN + (uint64_t)frame * 1000003ull + (uint64_t)book);
}

// U(0, 1) of token `tok` (the same double operations as sampling.uniforms)
inline double uniform(uint64_t key, int64_t tok) {
  const uint64_t x = mix(key + (uint64_t)tok * GOLDEN);
  return ((double)(x >> 11) + 0.5) / 9007199254740992.0;
}

// ---- sampling.choose for one row -----------------------------------------------------------------------------------
struct RowParams {           // [B] each (sampling.RowParams' sub-talker fields)
  const uint8_t* do_sample;  // bool
  const int64_t* top_k;
  const float* top_p;
  const float* temperature;
  const int64_t* seed;
  const int64_t* frame;
};

struct Facts {               // sampling.host_facts(...)["sub"]
  int any_sample;
  int64_t k_max;             // 0: the whole vocabulary
  int any_top_p;
};

int g_team = 0;                // ttsp_set_team: the stack of each pass as fused_step.cpp TeamMode (0: run_stack)
int g_frame_team = 1;          // ttsp_set_team's second half: a team mode runs the whole frame in one region

struct Work {
  std::vector<std::pair<float, int64_t>> queue;   // torch.topk's (value, index) pairs
  std::vector<float> vals;
  std::vector<std::pair<float, int64_t>> asc;     // top-p's ascending sort
  std::vector<float> prob;
};

inline bool nan_f(float x) { return x != x; }

// top-p of sampling._top_p over the k candidates (vals in place): sort ascending, softmax, cumulative sum (double, as
// torch's CPU cumsum accumulates fp32), drop positions whose cumulative mass <= 1 - top_p except the last.
// torch sorts with an unstable sort (x86-simd-sort or std::sort): among candidates of equal value at the cut the one
// dropped can differ from torch's (tests measure how often that changes a draw).
void top_p_row(float* vals, int64_t k, float top_p, Work& w) {
  w.asc.resize(k);
  for (int64_t i = 0; i < k; ++i) w.asc[i] = {vals[i], i};
  std::sort(w.asc.begin(), w.asc.end(), [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) {
    return (!nan_f(x.first) && nan_f(y.first)) || (x.first < y.first);
  });
  float mx = -INFINITY;
  for (int64_t i = 0; i < k; ++i) mx = std::max(mx, w.asc[i].first);
  w.prob.resize(k);
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    w.prob[i] = std::exp(w.asc[i].first - mx);
    sum += w.prob[i];
  }
  const float inv = 1.0f / sum;
  const float thr = 1.0f - top_p;
  double cum = 0.0;
  for (int64_t i = 0; i < k - 1; ++i) {   // the last (most likely) is always kept
    cum += (double)(w.prob[i] * inv);
    if ((float)cum <= thr) vals[w.asc[i].second] = -INFINITY;
  }
}

// logits [V] (fp32) -> the chosen id of codebook `book` for row b: the argmax for greedy rows (first maximum, as
// torch.argmax), else the Gumbel-max draw of sampling.choose: torch.topk(logits, k_max) (the same partial sort as
// torch's CPU topk_impl_loop, so equal values come out in the same order), the row's own top-k by rank, temperature,
// top-p, then argmax over candidates of (double) value - log(-log(u(seed, frame, book, id))).
// (A selection of the n best as a set, without the sort, was tried: it cannot tell which of several logits equal
// to the n-th largest torch keeps, and bf16-rounded logits tie at the cut in most draws; at k 50 it saved nothing.)
int64_t choose_row(const float* logits, int64_t V, const RowParams& rp, int64_t b, int64_t book, const Facts& f,
                   Work& w) {
  if (!f.any_sample || !rp.do_sample[b]) {   // (a sampled row needs no argmax)
    int64_t greedy = 0;
    float best = logits[0];
    for (int64_t i = 1; i < V; ++i)
      if (logits[i] > best || (nan_f(logits[i]) && !nan_f(best))) {
        best = logits[i];
        greedy = i;
      }
    return greedy;
  }
  const int64_t k = f.k_max > 0 ? std::min(f.k_max, V) : V;
  auto& q = w.queue;
  q.resize(V);
  for (int64_t i = 0; i < V; ++i) q[i] = {logits[i], i};
  auto desc = [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) {
    return (nan_f(x.first) && !nan_f(y.first)) || (x.first > y.first);
  };
  if (k * 64 <= V) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), desc);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), desc);
    std::sort(q.begin(), q.begin() + k - 1, desc);
  }
  w.vals.resize(k);
  const float temp = rp.temperature[b];
  const int64_t tk = rp.top_k[b];
  for (int64_t i = 0; i < k; ++i) w.vals[i] = (tk <= 0 || i < tk) ? q[i].first / temp : -INFINITY;
  if (f.any_top_p && rp.top_p[b] < 1.0f) top_p_row(w.vals.data(), k, rp.top_p[b], w);
  const uint64_t key = row_key(rp.seed[b], rp.frame[b], book);
  int64_t pick = 0;
  double top = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    const double g = (double)w.vals[i] - std::log(-std::log(uniform(key, q[i].second)));
    if (i == 0 || g > top) {
      top = g;
      pick = i;
    }
  }
  return q[pick].second;
}

// ---- the frame's profile (on with fused_step.cpp's switch, ttsf_profile_set; ttsp_profile_read) ------------------
// Per stage of a frame, nanoseconds summed over calls (the stack's own stages go to fused_step.cpp's profile as
// ever): F_SETUP scratch and the first pass's input rows, F_PROJ small_to_mtp_projection, F_STACK the decoder stack
// calls, F_NORM the final norms (rounded), F_HEAD the lm_heads' matmuls, F_ROUND the logits' rounding (and copy
// out), F_SAMPLE the choice of each codebook, F_EMBED the next pass's embedding rows, F_CALL the whole call.
enum FStage { F_SETUP, F_PROJ, F_STACK, F_NORM, F_HEAD, F_ROUND, F_SAMPLE, F_EMBED, F_CALL, F_CALLS, NFSTAGES };
int64_t g_facc[NFSTAGES];

inline void flap(int st, int64_t& t0) {
  if (!fstep::g_prof) return;
  const int64_t t = fstep::now_ns();
  g_facc[st] += t - t0;
  t0 = t;
}

// ---- the frame ----------------------------------------------------------------------------------------------------
enum HeadField { HEAD_W = 0, HEAD_S, HEAD_FIELDS };                    // per codebook 1..15: weight, scale127 or 0
enum ProjField { PROJ_W = 0, PROJ_S, PROJ_BIAS, PROJ_DT, PROJ_FIELDS };  // small_to_mtp_projection (PROJ_W 0: none)

inline float round_to(float v, int bf16) { return bf16 ? fstep::bf16_to_f32(f32_to_bf16(v)) : v; }

inline float load_act(const void* p, int bf16, int64_t i) {
  return bf16 ? fstep::bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

// the scratch vectors big enough for a matmul of M rows, N outputs, K inputs (linear() indexes them M x padded K / N)
void grow(Scratch& s, const Plan& p, int64_t M, int64_t N, int64_t K) {
  auto at_least = [](auto& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
  };
  const int64_t Kp = round_up(K, G4), Np = round_up(N, BLK);
  if (p.wbits == 16) {
    at_least(s.x.xb, M * Kp);
    at_least(s.x.xf, M * Kp);
    return;
  }
  at_least(s.x.xq, M * Kp);
  at_least(s.x.amax, M);
  at_least(s.x.xsum, M);
  at_least(s.x.gsum, M * (Kp / G4));
  if (p.wbits == 8) at_least(s.acc, M * Np);
  else at_least(s.facc, M * Np);
}

struct Frame {
  const Plan& p;
  const Cache& c;
  int bf16;                 // the activation dtype (the cache's) is bf16
  int64_t B, V, books, Dt;  // books: passes (15)
  const int64_t* heads;     // [books, HEAD_FIELDS]
  const int64_t* embeds;    // [books - 1] pointers: codec_embedding[j].weight [V, Dt] in the activation dtype
  const int64_t* proj;      // [PROJ_FIELDS]
};

// rows xin [M, Dt] (fp32 holding activation-dtype values) -> the stack's input s.h [M, D]: the projection (rounded
// as the eager W8A8Linear / W4A8Linear: result in the activation dtype, plus the bias in it) or a copy
void stack_input(const Frame& f, const float* xin, int64_t M, Scratch& s, std::vector<float>& tmp) {
  const int64_t D = f.p.D;
  if (!f.proj[PROJ_W]) {
    std::copy(xin, xin + M * D, s.h.begin());
    return;
  }
  const Lin l{(const uint8_t*)(intptr_t)f.proj[PROJ_W], (const float*)(intptr_t)f.proj[PROJ_S], D, f.Dt};
  tmp.resize(M * D);
  int64_t t0 = fstep::g_prof ? fstep::now_ns() : 0;   // (the projection counts as fused_step's P_IO)
  fstep::linear(f.p, l, xin, M, tmp.data(), s, fstep::P_IO, t0);
  const void* bias = (const void*)(intptr_t)f.proj[PROJ_BIAS];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < D; ++i) {
      float v = round_to(tmp[m * D + i], f.bf16);
      if (bias) v = round_to(v + load_act(bias, f.bf16, i), f.bf16);
      s.h[m * D + i] = v;
    }
}

// ---- the whole frame in one parallel region (team modes, no projection) -------------------------------------------
// Every thread of the team runs every pass: the stack as fused_step.cpp's team_member (its shared stages claimed or
// split), then the final norm, the lm_head as one more shared stage (its output units claimed like a matmul's of the
// stack), and - each thread on its own copy of the shared logits - the rounding, the choice of the codebook (the
// same deterministic draw on every thread) and the next pass's embedding rows. So the frame forks once, not once
// per matmul (split) or per pass; thread 0 writes the codes and the profile. A pass takes 5 L + 1 stages and
// 4 L + 1 consume points of one Sync (the last: the logits read, which the next pass's head guards); the stack's
// guards of its first layer then wait for the previous pass's later consume points, which is only stricter.
struct Team {
  fstep::Shared& sh;
  fstep::Sync& sy;
  std::vector<float>& logits;   // [B, V] the head's output, shared
};

template <class C>
bool frame_member(const Frame& f, const void* h, const void* emb0, const int64_t* c0, const RowParams& rp,
                  const Facts& facts, int64_t* codes, float* logits_out, Team& tm, int tid) {
  const Plan& p = f.p;
  const int64_t B = f.B, D = p.D, V = f.V, M0 = 2 * B, L = p.L;
  const int nt = tm.sy.nt;
  const bool prof = fstep::g_prof && tid == 0;
  int64_t ft = prof ? fstep::now_ns() : 0;
  auto tlap = [&](int st) { if (prof) flap(st, ft); };
  std::vector<float> x(M0 * D), hid(B * D), lg(B * V);
  std::vector<int64_t> row(M0), pos(M0), mine(B);
  fstep::Act act(p, B);
  Work w;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < D; ++i) {
      x[(2 * b) * D + i] = load_act(h, f.bf16, b * D + i);
      x[(2 * b + 1) * D + i] = load_act(emb0, f.bf16, c0[b] * D + i);
    }
    row[2 * b] = row[2 * b + 1] = b;
    pos[2 * b] = 0;
    pos[2 * b + 1] = 1;
  }
  tlap(F_SETUP);
  int64_t M = M0;
  for (int64_t j = 0; j < f.books; ++j) {
    const int64_t k0 = j * (5 * L + 1), cp0 = j * (4 * L + 1), cp_logits = cp0 + 4 * L;
    if (!fstep::team_member<C>(p, f.c, row.data(), pos.data(), M, tm.sh, tm.sy, x.data(), tid, k0, cp0)) return false;
    tlap(F_STACK);
    const int64_t per = M / B;
    for (int64_t b = 0; b < B; ++b) {
      float* out = &hid[b * D];
      fstep::rms_norm_row(&x[(b * per + per - 1) * D], p.final_norm, D, p.eps, out);
      for (int64_t i = 0; i < D; ++i) out[i] = round_to(out[i], f.bf16);
    }
    tlap(F_NORM);
    const int64_t* hf = f.heads + j * HEAD_FIELDS;
    const Lin head{(const uint8_t*)(intptr_t)hf[HEAD_W], (const float*)(intptr_t)hf[HEAD_S], V, D};
    fstep::prep(p, D, hid.data(), B, act);
    const int64_t U = fstep::units(p, head);
    tm.sy.guard(tid, cp_logits - (4 * L + 1));   // the previous pass's logits read by every thread
    tm.sy.run(k0 + 5 * L, tid, U, fstep::chunk_of(p, head, U, nt), [&](int64_t b0, int64_t b1) {
      fstep::mm_range(p, head, act, B, b0, b1, tm.logits.data(), tm.sh.acc.data(), tm.sh.facc.data());
    });
    tlap(F_HEAD);
    if (!tm.sy.consume_begin(tid, cp_logits)) return false;
    for (int64_t i = 0; i < B * V; ++i) lg[i] = round_to(tm.logits[i], f.bf16);
    tm.sy.consume_end(tid, cp_logits);
    if (tid == 0 && logits_out) std::copy(lg.begin(), lg.end(), logits_out + j * B * V);
    tlap(F_ROUND);
    for (int64_t b = 0; b < B; ++b) {
      mine[b] = choose_row(&lg[b * V], V, rp, b, j + 1, facts, w);
      if (tid == 0) codes[b * f.books + j] = mine[b];
    }
    tlap(F_SAMPLE);
    if (j + 1 == f.books) break;
    const void* e = (const void*)(intptr_t)f.embeds[j];
    M = B;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < D; ++i) x[b * D + i] = load_act(e, f.bf16, mine[b] * D + i);
      row[b] = b;
      pos[b] = j + 2;
    }
    tlap(F_EMBED);
  }
  return true;
}

template <class C>
void run_frame_team(const Frame& f, const void* h, const void* emb0, const int64_t* c0, const RowParams& rp,
                    const Facts& facts, int64_t* codes, float* logits_out, int nt, int mode) {
  const Plan& p = f.p;
  const int64_t B = f.B, V = f.V, L = p.L, Np = round_up(V, BLK);
  fstep::Shared sh(p, 2 * B);
  if (p.wbits == 8 && (int64_t)sh.acc.size() < B * Np) sh.acc.resize(B * Np);      // the heads' sums too
  if (p.wbits == 4 && (int64_t)sh.facc.size() < B * Np) sh.facc.resize(B * Np);
  std::vector<float> logits(B * V);
  const int64_t stages = f.books * (5 * L + 1);
  fstep::Sync sy(mode, nt, stages);
  Team tm{sh, sy, logits};
  bool short_team = false;
#pragma omp parallel num_threads(nt)
  {
    if (omp_get_num_threads() != nt) {
#pragma omp atomic write
      short_team = true;
    } else {
      frame_member<C>(f, h, emb0, c0, rp, facts, codes, logits_out, tm, omp_get_thread_num());
    }
  }
  if (short_team) {   // fewer threads than asked: the caller alone
    fstep::Sync one(mode, 1, stages);
    Team t1{sh, one, logits};
    frame_member<C>(f, h, emb0, c0, rp, facts, codes, logits_out, t1, 0);
    one.profile_done();
    return;
  }
  sy.profile_done();
}

template <class C>
int run_frame(const Frame& f, const void* h, const void* emb0, const int64_t* c0, const RowParams& rp,
              const Facts& facts, int64_t* codes, float* logits_out, int team_mode) {
  const Plan& p = f.p;
  const int64_t B = f.B, D = p.D, V = f.V, Dt = f.Dt, M0 = 2 * B;
  const int64_t call0 = fstep::g_prof ? fstep::now_ns() : 0;
  int64_t ft = call0;
  const int nt = std::min(at::get_num_threads(), fstep::MAX_THREADS);
  const int team = nt > 1 && !omp_in_parallel() ? team_mode : 0;   // each pass's stack in one parallel region ...
  if (team && g_frame_team && !f.proj[PROJ_W]) {                  // ... or the whole frame in one
    run_frame_team<C>(f, h, emb0, c0, rp, facts, codes, logits_out, nt, team);
    if (fstep::g_prof) {
      g_facc[F_CALL] += fstep::now_ns() - call0;
      g_facc[F_CALLS] += 1;
    }
    return 0;
  }
  Scratch s(p, M0);
  grow(s, p, B, V, D);                 // the heads
  if (f.proj[PROJ_W]) grow(s, p, M0, D, Dt);
  std::vector<float> xin(M0 * Dt), hid(B * D), logits(B * V), tmp;
  std::vector<int64_t> row(M0), pos(M0);
  Work w;
  for (int64_t b = 0; b < B; ++b) {   // pass 0: [h, E0(c0)] at positions 0 and 1 of cache row b
    for (int64_t i = 0; i < Dt; ++i) {
      xin[(2 * b) * Dt + i] = load_act(h, f.bf16, b * Dt + i);
      xin[(2 * b + 1) * Dt + i] = load_act(emb0, f.bf16, c0[b] * Dt + i);
    }
    row[2 * b] = row[2 * b + 1] = b;
    pos[2 * b] = 0;
    pos[2 * b + 1] = 1;
  }
  flap(F_SETUP, ft);
  int64_t M = M0;
  for (int64_t j = 0; j < f.books; ++j) {
    stack_input(f, xin.data(), M, s, tmp);
    flap(F_PROJ, ft);
    if (team) fstep::run_team<C>(p, f.c, row.data(), pos.data(), M, s.h.data(), nt, team);
    else fstep::run_stack<C>(p, f.c, row.data(), pos.data(), M, s);
    flap(F_STACK, ft);
    const int64_t per = M / B;         // entries per row: the last one's hidden feeds the head
    for (int64_t b = 0; b < B; ++b) {
      float* out = &hid[b * D];
      fstep::rms_norm_row(&s.h[(b * per + per - 1) * D], p.final_norm, D, p.eps, out);
      for (int64_t i = 0; i < D; ++i) out[i] = round_to(out[i], f.bf16);
    }
    flap(F_NORM, ft);
    const int64_t* hf = f.heads + j * HEAD_FIELDS;
    const Lin head{(const uint8_t*)(intptr_t)hf[HEAD_W], (const float*)(intptr_t)hf[HEAD_S], V, D};
    int64_t t0 = fstep::g_prof ? fstep::now_ns() : 0;   // (the heads count as fused_step's P_IO in its profile)
    fstep::linear(p, head, hid.data(), B, logits.data(), s, fstep::P_IO, t0);
    flap(F_HEAD, ft);
    for (int64_t i = 0; i < B * V; ++i) logits[i] = round_to(logits[i], f.bf16);
    if (logits_out) std::copy(logits.begin(), logits.end(), logits_out + j * B * V);
    flap(F_ROUND, ft);
    for (int64_t b = 0; b < B; ++b) codes[b * f.books + j] = choose_row(&logits[b * V], V, rp, b, j + 1, facts, w);
    flap(F_SAMPLE, ft);
    if (j + 1 == f.books) break;
    const void* e = (const void*)(intptr_t)f.embeds[j];
    M = B;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t id = codes[b * f.books + j];
      for (int64_t i = 0; i < Dt; ++i) xin[b * Dt + i] = load_act(e, f.bf16, id * Dt + i);
      row[b] = b;
      pos[b] = j + 2;
    }
    flap(F_EMBED, ft);
  }
  if (fstep::g_prof) {
    g_facc[F_CALL] += fstep::now_ns() - call0;
    g_facc[F_CALLS] += 1;
  }
  return 0;
}

}  // namespace pframe

extern "C" {

int ttsp_version() { return 1; }

// The frame's profile sums (pframe::FStage, ns; the last a count) -> out, zeroed; returns NFSTAGES. On and off with
// this library's ttsf_profile_set (the stack's stages: its ttsf_profile_read).
int ttsp_profile_read(int64_t* out) {
  for (int i = 0; i < pframe::NFSTAGES; ++i) {
    out[i] = pframe::g_facc[i];
    pframe::g_facc[i] = 0;
  }
  return pframe::NFSTAGES;
}

// How each pass runs its stack: fstep::TeamMode (0 split: run_stack; 1 barrier / 2 claim: run_team, one parallel
// region per pass, or with frame_region the whole frame in one). predictor_frame.py sets it from TTS_FUSED_TEAM as fused_step.py sets ttsf_set_team; the same
// numbers either way. Returns the setting before.
// frame_region: 1 the whole frame in one parallel region (run_frame_team; not with a projection), 0 one per pass.
int ttsp_set_team(int mode, int frame_region) {
  const int was = pframe::g_team;
  pframe::g_team = mode;
  pframe::g_frame_team = frame_region;
  return was;
}

// The sampler alone (tests): logits [B, V] fp32 -> codes [B] of codebook `book`, as sampling.choose.
void ttsp_choose(const float* logits, int64_t B, int64_t V, int64_t book, const uint8_t* do_sample,
                 const int64_t* top_k, const float* top_p, const float* temperature, const int64_t* seed,
                 const int64_t* frame, int any_sample, int64_t k_max, int any_top_p, int64_t* codes) {
  const pframe::RowParams rp{do_sample, top_k, top_p, temperature, seed, frame};
  const pframe::Facts f{any_sample, k_max, any_top_p};
  pframe::Work w;
  for (int64_t b = 0; b < B; ++b) codes[b] = pframe::choose_row(logits + b * V, V, rp, b, book, f, w);
}

// One frame of the code predictor for B rows (module comment). Stack arguments as ttsf_stack_step (cache rows 0..B-1,
// positions 0..books written); heads [books, 2], embeds [books - 1], proj [4] (pframe enums); h [B, Dt] and emb0 (the
// talker's codec embedding [*, Dt]) in the cache's dtype; c0 [B]; sampling rows and facts as sampling.choose's ->
// codes [B, books] (codebooks 1..books); logits_out [books, B, V] fp32 or NULL. Returns 0, or a negative code for an
// input it refuses (nothing written then).
// ttsp_frame with the way it uses torch's threads given (fstep::TeamMode; -1: ttsp_set_team's setting)
int ttsp_frame_team(const int64_t* dims, float eps, const int64_t* layers, const float* inv_freq, const float* final_norm,
               void* kc, void* vc, const int64_t* cache_strides, int cache_is_bf16, int64_t B, int64_t V,
               int64_t books, const int64_t* heads, const int64_t* embeds, const int64_t* proj, const void* h,
               const void* emb0, const int64_t* c0, const uint8_t* do_sample, const int64_t* top_k,
               const float* top_p, const float* temperature, const int64_t* seed, const int64_t* frame,
               int any_sample, int64_t k_max, int any_top_p, int64_t* codes, float* logits_out, int team) {
  fstep::Plan p{dims[fstep::L_], dims[fstep::D_], dims[fstep::H_], dims[fstep::HKV_], dims[fstep::HD_],
                dims[fstep::I_], dims[fstep::WBITS_], dims[fstep::ISA_], eps, layers, inv_freq, final_norm};
  fstep::Cache c{kc, vc, cache_strides[0], cache_strides[1], cache_strides[2], cache_strides[3], cache_is_bf16};
  if (B < 1 || V < 1 || books < 1 || p.hd % 2 || p.H % p.Hkv || (p.wbits != 8 && p.wbits != 4 && p.wbits != 16) ||
      ((p.wbits == 8 || p.wbits == 4) && !isa_ok((int)p.isa)))
    return -1;
  if (p.wbits == 16 && (p.isa < 1 || p.isa > ttsf_bf16_isa() || p.D % 32 || (p.H * p.hd) % 32 || p.I % 32 ||
                        ((p.H + 2 * p.Hkv) * p.hd) % fstep::R4 || V % fstep::R4 || (proj[pframe::PROJ_W] &&
                        (proj[pframe::PROJ_DT] % 32 || p.D % fstep::R4))))
    return -1;
  if (books >= c.max_len) return -2;   // positions 0..books
  const int64_t Dt = proj[pframe::PROJ_W] ? proj[pframe::PROJ_DT] : p.D;
  for (int64_t b = 0; b < B; ++b)
    if (c0[b] < 0) return -3;
  const pframe::Frame f{p, c, cache_is_bf16, B, V, books, Dt, heads, embeds, proj};
  const pframe::RowParams rp{do_sample, top_k, top_p, temperature, seed, frame};
  const pframe::Facts facts{any_sample, k_max, any_top_p};
  if (team < 0) team = pframe::g_team;
  if (cache_is_bf16) return pframe::run_frame<uint16_t>(f, h, emb0, c0, rp, facts, codes, logits_out, team);
  return pframe::run_frame<float>(f, h, emb0, c0, rp, facts, codes, logits_out, team);
}

int ttsp_frame(const int64_t* dims, float eps, const int64_t* layers, const float* inv_freq, const float* final_norm,
               void* kc, void* vc, const int64_t* cache_strides, int cache_is_bf16, int64_t B, int64_t V,
               int64_t books, const int64_t* heads, const int64_t* embeds, const int64_t* proj, const void* h,
               const void* emb0, const int64_t* c0, const uint8_t* do_sample, const int64_t* top_k,
               const float* top_p, const float* temperature, const int64_t* seed, const int64_t* frame,
               int any_sample, int64_t k_max, int any_top_p, int64_t* codes, float* logits_out) {
  return ttsp_frame_team(dims, eps, layers, inv_freq, final_norm, kc, vc, cache_strides, cache_is_bf16, B, V, books,
                         heads, embeds, proj, h, emb0, c0, do_sample, top_k, top_p, temperature, seed, frame,
                         any_sample, k_max, any_top_p, codes, logits_out, -1);
}

}  // extern "C"
