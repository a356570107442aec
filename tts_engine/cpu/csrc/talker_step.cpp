// The talker's whole per-frame step in one call (part of the one library, ttsx.cpp; tts_engine/cpu/talker_step.py calls
// it through ctypes).
//
// For B rows r[b] of the model runner (ModelRunner._advance from Python, computation for computation):
//   x = sum of the 16 code embeddings of codes[b] (the frame table, fp32 sum in code order, rounded to the activation
//       dtype as torch's bf16 sum) + the row's trailing text vector at frame step-1 (or tts_pad past its end), rounded;
//   h = the fused talker stack (fused_step.cpp run_stack, the same kernels and cache writes as a FusedStep call) at
//       cache row r[b], position pos[r[b]], then the final norm, rounded to the activation dtype (the stack's output);
//   logits = codec_head(h) (the stack's own matmul kernel on the head's packed weight, rounded as the eager layer's
//       output), then sampling.C0Processor: repetition penalty over seen[r[b]], EOS blocked while step < min_new or
//       ignore_eos, the suppressed ids [suppress_from, V) except EOS to -inf, then sampling.choose with the codebook-0
//       parameters (predictor_frame.cpp choose_row: greedy argmax, top-k in torch's order, temperature, top-p,
//       counter-hash Gumbel-max at (seed, frame = step, book 0));
//   state (ModelRunner._after_c0): pos = min(pos + 1, max_len - 1), seen[c0] = 1, step += 1, hidden = h, c0 -> done =
//       c0 == eos or step >= max_new.
// Where the head cannot be computed here with the eager layer's exact numbers (bf16 heads: aten's gemv sums in another
// order; a W8A8 head on the bf16-scale kernel), the step comes in two calls with the head in Python between them:
// ttst_hidden (embedding and stack -> h) and ttst_choose (sampling and state from the given logits).
// What it uses of predictor_frame.cpp (keep in step when that file changes): pframe::RowParams, Facts, Work,
// choose_row(), round_to(), load_act(), grow(); and of fused_step.cpp: Plan, Cache, Lin, Scratch, linear(), run_stack(),
// rms_norm_row().
#pragma once   // one translation unit includes every source once (ttsx.cpp)
#include "predictor_frame.cpp"

namespace tstep {

using fstep::Cache;
using fstep::Lin;
using fstep::Plan;
using fstep::Scratch;

// the model runner's state tensors (all rows R; indexed by r[b])
struct State {
  int64_t* pos;              // [R]
  int64_t* step;             // [R]
  const int64_t* max_new;    // [R]
  uint8_t* seen;             // [R, V] bool
  void* hidden;              // [R, D] activation dtype
  int64_t* c0;               // [R]
  const void* trailing;      // [R, cap, D] activation dtype
  const int64_t* trailing_len;  // [R]
  const void* tts_pad;       // [D]
  int64_t cap, max_len;
};

struct C0Rules {             // C0Processor's constants and the rows' codebook-0 sampling parameters ([B] each)
  int64_t eos, min_new, suppress_from;
  const uint8_t* do_sample;
  const int64_t* top_k;
  const float* top_p;
  const float* temperature;
  const float* penalty;
  const int64_t* seed;
  const uint8_t* ignore_eos;
  pframe::Facts facts;
};

// embedding + stack + final norm for the B rows -> hid [B, D] (fp32 holding activation-dtype values)
template <class C>
void hidden_of(const Plan& p, const Cache& c, int bf16, int64_t B, const int64_t* r, const int64_t* codes,
               int64_t books, const void* table, const int64_t* offsets, const State& st, Scratch& s, float* hid) {
  const int64_t D = p.D;
  std::vector<int64_t> pos(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = r[b];
    float* x = &s.h[b * D];
    for (int64_t i = 0; i < D; ++i) x[i] = 0.f;
    for (int64_t j = 0; j < books; ++j) {
      const int64_t id = codes[b * books + j] + offsets[j];
      for (int64_t i = 0; i < D; ++i) x[i] += pframe::load_act(table, bf16, id * D + i);
    }
    const int64_t g = st.step[row] - 1;
    const int64_t gi = std::min(g, st.cap - 1);
    const bool text = g < st.trailing_len[row];
    for (int64_t i = 0; i < D; ++i) {
      const float t = text ? pframe::load_act(st.trailing, bf16, (row * st.cap + gi) * D + i)
                           : pframe::load_act(st.tts_pad, bf16, i);
      x[i] = pframe::round_to(pframe::round_to(x[i], bf16) + t, bf16);
    }
    pos[b] = st.pos[row];
  }
  fstep::run_stack<C>(p, c, r, pos.data(), B, s);
  for (int64_t b = 0; b < B; ++b) {
    float* out = &hid[b * D];
    fstep::rms_norm_row(&s.h[b * D], p.final_norm, D, p.eps, out);
    for (int64_t i = 0; i < D; ++i) out[i] = pframe::round_to(out[i], bf16);
  }
}

// C0Processor + choose + _after_c0 for the B rows from logits [B, V] (fp32 holding activation-dtype values; changed
// in place) and hid [B, D]
void choose_and_update(int bf16, int64_t B, int64_t D, int64_t V, const int64_t* r, float* logits, const float* hid,
                       const C0Rules& rule, const State& st, uint8_t* done, int64_t* c0_out) {
  std::vector<int64_t> frame(B);
  for (int64_t b = 0; b < B; ++b) frame[b] = st.step[r[b]];
  const pframe::RowParams rp{rule.do_sample, rule.top_k, rule.top_p, rule.temperature, rule.seed, frame.data()};
  pframe::Work w;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = r[b];
    float* l = logits + b * V;
    const uint8_t* seen = st.seen + row * V;
    const float pen = rule.penalty[b];
    for (int64_t i = 0; i < V; ++i)
      if (seen[i]) l[i] = l[i] < 0 ? l[i] * pen : l[i] / pen;
    if (st.step[row] < rule.min_new || rule.ignore_eos[b]) l[rule.eos] = -INFINITY;
    for (int64_t i = std::max<int64_t>(0, rule.suppress_from); i < V; ++i)
      if (i != rule.eos) l[i] = -INFINITY;
    const int64_t c0 = pframe::choose_row(l, V, rp, b, 0, rule.facts, w);
    st.pos[row] = std::min(st.pos[row] + 1, st.max_len - 1);
    st.seen[row * V + c0] = 1;
    st.step[row] += 1;
    for (int64_t i = 0; i < D; ++i) {
      if (bf16) ((uint16_t*)st.hidden)[row * D + i] = f32_to_bf16(hid[b * D + i]);
      else ((float*)st.hidden)[row * D + i] = hid[b * D + i];
    }
    st.c0[row] = c0;
    c0_out[b] = c0;
    done[b] = c0 == rule.eos || st.step[row] >= st.max_new[row];
  }
}

}  // namespace tstep

extern "C" {

int ttst_version() { return 1; }

// Argument groups shared by the calls:
//   stack: dims, eps, layers, inv_freq, final_norm, k, v, cache_strides, cache_is_bf16 (as ttsf_stack_step)
//   state: pos, step, max_new, seen, hidden, c0, trailing, trailing_len, tts_pad, cap, max_len (State above)
//   rows:  B, r [B] (runner rows = cache rows; distinct, checked by the caller)
//   frame: codes [B, books] int64, books, table (the frame table [*, D]), offsets [books]
//   rules: eos, min_new, suppress_from, do_sample, top_k, top_p, temperature, penalty, seed, ignore_eos [B],
//          any_sample, k_max, any_top_p
// Returns 0, or a negative code for an input it refuses (nothing written then).
#define TTST_STACK_ARGS                                                                                            \
  const int64_t *dims, float eps, const int64_t *layers, const float *inv_freq, const float *final_norm, void *kc, \
      void *vc, const int64_t *cache_strides, int cache_is_bf16
#define TTST_STATE_ARGS                                                                                            \
  int64_t *pos, int64_t *step, const int64_t *max_new, uint8_t *seen, void *hidden, int64_t *c0,                  \
      const void *trailing, const int64_t *trailing_len, const void *tts_pad, int64_t cap, int64_t max_len
#define TTST_RULE_ARGS                                                                                             \
  int64_t eos, int64_t min_new, int64_t suppress_from, const uint8_t *do_sample, const int64_t *top_k,           \
      const float *top_p, const float *temperature, const float *penalty, const int64_t *seed,                   \
      const uint8_t *ignore_eos, int any_sample, int64_t k_max, int any_top_p

static int ttst_check(const fstep::Plan& p, const fstep::Cache& c, int64_t B, const int64_t* r, const int64_t* pos,
                      const int64_t* codes, int64_t books, const int64_t* offsets, int64_t table_rows) {
  if (B < 1 || p.hd % 2 || p.H % p.Hkv || (p.wbits != 8 && p.wbits != 4 && p.wbits != 16) ||
      ((p.wbits == 8 || p.wbits == 4) && !isa_ok((int)p.isa)))
    return -1;
  if (p.wbits == 16 && (p.isa < 1 || p.isa > ttsf_bf16_isa() || p.D % 32 || (p.H * p.hd) % 32 || p.I % 32 ||
                        ((p.H + 2 * p.Hkv) * p.hd) % fstep::R4))
    return -1;
  for (int64_t b = 0; b < B; ++b) {
    if (r[b] < 0 || pos[r[b]] < 0 || pos[r[b]] >= c.max_len) return -2;
    for (int64_t j = 0; j < books; ++j) {
      const int64_t id = codes[b * books + j] + offsets[j];
      if (codes[b * books + j] < 0 || id < 0 || id >= table_rows) return -3;
    }
  }
  return 0;
}

static fstep::Plan ttst_plan(const int64_t* dims, float eps, const int64_t* layers, const float* inv_freq,
                             const float* final_norm) {
  return fstep::Plan{dims[fstep::L_], dims[fstep::D_], dims[fstep::H_], dims[fstep::HKV_], dims[fstep::HD_],
                     dims[fstep::I_], dims[fstep::WBITS_], dims[fstep::ISA_], eps, layers, inv_freq, final_norm};
}

// The whole step (module comment): head_w / head_s the codec head in the stack's kernel layout (head_s: W8A8 scale127,
// else NULL), V its outputs -> c0_out [B], done [B] (bool), the runner's state updated; logits_out [B, V] fp32 (the
// processed logits before sampling are not kept: these are the head's, rounded) or NULL.
int ttst_step(TTST_STACK_ARGS, TTST_STATE_ARGS, int64_t B, const int64_t* r, const int64_t* codes, int64_t books,
              const void* table, const int64_t* offsets, int64_t table_rows, const void* head_w, const float* head_s,
              int64_t V, TTST_RULE_ARGS, int64_t* c0_out, uint8_t* done, float* logits_out) {
  const fstep::Plan p = ttst_plan(dims, eps, layers, inv_freq, final_norm);
  const fstep::Cache c{kc, vc, cache_strides[0], cache_strides[1], cache_strides[2], cache_strides[3], cache_is_bf16};
  const int rc = ttst_check(p, c, B, r, pos, codes, books, offsets, table_rows);
  if (rc) return rc;
  if (V < 1 || !head_w || (p.wbits == 16 && V % fstep::R4)) return -1;
  const tstep::State st{pos, step, max_new, seen, hidden, c0, trailing, trailing_len, tts_pad, cap, max_len};
  const tstep::C0Rules rule{eos, min_new, suppress_from, do_sample, top_k, top_p, temperature, penalty, seed,
                            ignore_eos, pframe::Facts{any_sample, k_max, any_top_p}};
  fstep::Scratch s(p, B);
  pframe::grow(s, p, B, V, p.D);
  std::vector<float> hid(B * p.D), logits(B * V);
  if (cache_is_bf16) tstep::hidden_of<uint16_t>(p, c, 1, B, r, codes, books, table, offsets, st, s, hid.data());
  else tstep::hidden_of<float>(p, c, 0, B, r, codes, books, table, offsets, st, s, hid.data());
  const fstep::Lin head{(const uint8_t*)head_w, head_s, V, p.D};
  int64_t t0 = 0;   // (the head counts as fused_step's P_IO in its profile)
  fstep::linear(p, head, hid.data(), B, logits.data(), s, fstep::P_IO, t0);
  for (int64_t i = 0; i < B * V; ++i) logits[i] = pframe::round_to(logits[i], cache_is_bf16);
  if (logits_out) std::copy(logits.begin(), logits.end(), logits_out);
  tstep::choose_and_update(cache_is_bf16, B, p.D, V, r, logits.data(), hid.data(), rule, st, done, c0_out);
  return 0;
}

// First half of the two-call step: embedding, stack, final norm -> h_out [B, D] in the activation dtype (the caller
// runs the codec head on it). Writes the cache (keys and values at pos) but no runner state.
int ttst_hidden(TTST_STACK_ARGS, TTST_STATE_ARGS, int64_t B, const int64_t* r, const int64_t* codes, int64_t books,
                const void* table, const int64_t* offsets, int64_t table_rows, void* h_out) {
  const fstep::Plan p = ttst_plan(dims, eps, layers, inv_freq, final_norm);
  const fstep::Cache c{kc, vc, cache_strides[0], cache_strides[1], cache_strides[2], cache_strides[3], cache_is_bf16};
  const int rc = ttst_check(p, c, B, r, pos, codes, books, offsets, table_rows);
  if (rc) return rc;
  const tstep::State st{pos, step, max_new, seen, hidden, c0, trailing, trailing_len, tts_pad, cap, max_len};
  fstep::Scratch s(p, B);
  std::vector<float> hid(B * p.D);
  if (cache_is_bf16) tstep::hidden_of<uint16_t>(p, c, 1, B, r, codes, books, table, offsets, st, s, hid.data());
  else tstep::hidden_of<float>(p, c, 0, B, r, codes, books, table, offsets, st, s, hid.data());
  for (int64_t i = 0; i < B * p.D; ++i) {
    if (cache_is_bf16) ((uint16_t*)h_out)[i] = f32_to_bf16(hid[i]);
    else ((float*)h_out)[i] = hid[i];
  }
  return 0;
}

// Second half: logits [B, V] fp32 (the head's, as Talker.forward_embeds returns them; changed in place) and h [B, D]
// (ttst_hidden's) -> c0_out [B], done [B], the runner's state updated.
int ttst_choose(int64_t D, TTST_STATE_ARGS, int64_t B, const int64_t* r, float* logits, int64_t V, const void* h,
                int h_is_bf16, TTST_RULE_ARGS, int64_t* c0_out, uint8_t* done) {
  if (B < 1 || V < 1 || D < 1) return -1;
  for (int64_t b = 0; b < B; ++b)
    if (r[b] < 0) return -2;
  const tstep::State st{pos, step, max_new, seen, hidden, c0, trailing, trailing_len, tts_pad, cap, max_len};
  const tstep::C0Rules rule{eos, min_new, suppress_from, do_sample, top_k, top_p, temperature, penalty, seed,
                            ignore_eos, pframe::Facts{any_sample, k_max, any_top_p}};
  std::vector<float> hid(B * D);
  for (int64_t i = 0; i < B * D; ++i) hid[i] = pframe::load_act(h, h_is_bf16, i);
  tstep::choose_and_update(h_is_bf16, B, D, V, r, logits, hid.data(), rule, st, done, c0_out);
  return 0;
}

}  // extern "C"
