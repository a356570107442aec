// AudioWorklet side of the live player (assets/live_player.js): a ring buffer of float32 samples at the stream's
// rate (24 kHz), played at the context's rate. The page decides when to play (its buffering policy); this processor
// plays while told to, and when the ring runs dry before the end of the stream it pauses by itself (an underrun: it
// waits for the page to resume it instead of playing crumbs). It reports what it did: the context frame of the first
// sample it rendered, samples played, their sum of squares (so the page can prove it played sound), underruns; all
// counted in the stream's samples.
//
// The context runs at the output device's own rate where it can (48 or 44.1 kHz): a context at 24 kHz makes the
// browser resample behind it, which costs ~10 ms more output latency in Chromium (measured: docs/benchmarks.md).
// Then this processor resamples itself: a windowed-sinc interpolator (TAPS_EACH_SIDE input samples on each side,
// so it holds back 2/3 ms of audio), its kernel tabulated at PHASES fractional positions (signal to error
// against the ideal: 104-108 dB for a 1 kHz tone, 83 dB at 7 kHz, 46 dB at 10 kHz; a plain copy at 24 kHz).
const TAPS_EACH_SIDE = 16, PHASES = 256, CUTOFF = 0.97;   // cutoff: a fraction of the stream's Nyquist frequency
const RING_MARGIN = 64;                                  // samples before the read position kept for the kernel

function kernelTable() {
  const n = 2 * TAPS_EACH_SIDE, table = new Float32Array((PHASES + 1) * n);
  for (let ph = 0; ph <= PHASES; ph++) {
    const frac = ph / PHASES;
    let sum = 0;
    for (let k = 0; k < n; k++) {
      const t = frac - (k - TAPS_EACH_SIDE + 1);           // distance from input sample read - N + 1 + k
      const x = Math.PI * CUTOFF * t;
      const sinc = t === 0 ? 1 : Math.sin(x) / x;
      const w = Math.abs(t) >= TAPS_EACH_SIDE ? 0
        : 0.42 + 0.5 * Math.cos(Math.PI * t / TAPS_EACH_SIDE) + 0.08 * Math.cos(2 * Math.PI * t / TAPS_EACH_SIDE);
      table[ph * n + k] = sinc * w;
      sum += sinc * w;
    }
    for (let k = 0; k < n; k++) table[ph * n + k] /= sum;   // unity gain at every phase
  }
  return table;
}

class LivePcmPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions || {};
    const inRate = o.inRate || 24000;
    const cap = Math.floor(o.capacity || inRate * 30);
    this.cap = cap + RING_MARGIN;   // the page keeps at most `cap` unread samples here; the margin keeps the past
    this.ring = new Float32Array(this.cap);
    this.step = inRate / sampleRate;   // stream samples per output sample (1: no resampling)
    this.kernel = this.step === 1 ? null : kernelTable();
    this.written = 0;          // samples written into the ring (all time, this run)
    this.read = 0;             // samples read (played or dropped)
    this.frac = 0;             // resampling: the output position lies this far past sample `read`
    this.playing = false;
    this.ended = false;        // the page said: no more data will come
    this.firstSent = false;
    this.played = 0;
    this.sumsq = 0;
    this.underruns = 0;
    this.quanta = 0;
    this.gen = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(m) {
    if (m.type === 'push') {
      const s = m.samples;
      for (let i = 0; i < s.length; i++) this.ring[(this.written + i) % this.cap] = s[i];
      this.written += s.length;
    } else if (m.type === 'play') {
      this.playing = true;
    } else if (m.type === 'pause') {
      this.playing = false;
    } else if (m.type === 'end') {
      this.ended = true;
    } else if (m.type === 'reset') {   // a new run, or Stop: drop everything, silence from the next quantum
      this.read = this.written = 0;
      this.frac = 0;
      this.playing = this.ended = this.firstSent = false;
      this.played = this.sumsq = this.underruns = 0;
      this.gen = m.gen;
      this.report();
    }
  }

  report(extra) {
    this.port.postMessage(Object.assign({type: 'stats', read: this.read, written: this.written,
      played: this.played, sumsq: this.sumsq, underruns: this.underruns, playing: this.playing,
      hold: this.kernel ? TAPS_EACH_SIDE + 1 : 0, frame: currentFrame, gen: this.gen}, extra || {}));
  }

  // Stream sample i (0 before the stream and past what was written).
  at(i) {
    return i < 0 || i >= this.written ? 0 : this.ring[i % this.cap];
  }

  // Fill out[0..n) at the stream's own rate; -> output samples filled.
  copy(out, n) {
    const k = Math.min(this.written - this.read, n);
    let ss = 0;
    for (let i = 0; i < k; i++) {
      const v = this.ring[(this.read + i) % this.cap];
      out[i] = v;
      ss += v * v;
    }
    this.read += k;
    this.played += k;
    this.sumsq += ss;
    return k;
  }

  // Fill out[0..n) resampled; -> output samples filled. An output sample needs TAPS_EACH_SIDE stream samples after
  // its position, except once the stream has ended (then the missing ones are silence).
  resample(out, n) {
    const N = TAPS_EACH_SIDE, taps = 2 * N, table = this.kernel;
    let j = 0;
    while (j < n) {
      if (this.ended ? this.read >= this.written : this.written - this.read <= N) break;
      const pf = this.frac * PHASES, ph = Math.floor(pf), a = pf - ph;
      const r0 = ph * taps, r1 = r0 + taps, base = this.read - N + 1;
      let y = 0;
      if (base >= 0 && base + taps <= this.written) {
        for (let k = 0; k < taps; k++) {
          const c = table[r0 + k] + a * (table[r1 + k] - table[r0 + k]);
          y += c * this.ring[(base + k) % this.cap];
        }
      } else {
        for (let k = 0; k < taps; k++) y += (table[r0 + k] + a * (table[r1 + k] - table[r0 + k])) * this.at(base + k);
      }
      out[j++] = y;
      this.frac += this.step;
      while (this.frac >= 1 && this.read < this.written) {   // the position moved past sample `read`
        const v = this.ring[this.read % this.cap];
        this.sumsq += v * v;
        this.played += 1;
        this.read += 1;
        this.frac -= 1;
      }
      if (this.frac >= 1) this.frac = 0;   // (only at the very end of an ended stream)
    }
    return j;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    const n = out.length;
    if (!this.playing) {
      out.fill(0);
    } else {
      const k = this.kernel ? this.resample(out, n) : this.copy(out, n);
      if (k < n) out.fill(0, k);
      if (k > 0 && !this.firstSent) {
        this.firstSent = true;
        this.port.postMessage({type: 'first', frame: currentFrame, gen: this.gen});
      }
      if (k < n) {
        this.playing = false;
        if (this.ended) {
          this.report({event: 'ended'});
        } else {
          this.underruns += 1;
          this.report({event: 'underrun'});
        }
      }
    }
    if (++this.quanta % 4 === 0) this.report();
    return true;
  }
}

registerProcessor('live-pcm-player', LivePcmPlayer);
