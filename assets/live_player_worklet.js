// AudioWorklet side of the live player (assets/live_player.js): a ring buffer of float32 samples at the
// context's rate (24 kHz). The page decides when to play (its buffering policy); this processor plays while told
// to, and when the ring runs dry before the end of the stream it pauses by itself (an underrun: it waits for the
// page to resume it instead of playing crumbs). It reports what it did: the context frame of the first sample it
// rendered, samples played, their sum of squares (so the page can prove it played sound), underruns.
class LivePcmPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const cap = Math.floor((options.processorOptions && options.processorOptions.capacity) || 24000 * 30);
    this.ring = new Float32Array(cap);
    this.cap = cap;
    this.written = 0;          // samples written into the ring (all time, this run)
    this.read = 0;             // samples read (played or dropped)
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
      this.playing = this.ended = this.firstSent = false;
      this.played = this.sumsq = this.underruns = 0;
      this.gen = m.gen;
      this.report();
    }
  }

  report(extra) {
    this.port.postMessage(Object.assign({type: 'stats', read: this.read, written: this.written,
      played: this.played, sumsq: this.sumsq, underruns: this.underruns, playing: this.playing,
      frame: currentFrame, gen: this.gen}, extra || {}));
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    const n = out.length;
    if (!this.playing) {
      out.fill(0);
    } else {
      const avail = this.written - this.read;
      const k = Math.min(avail, n);
      let ss = 0;
      for (let i = 0; i < k; i++) {
        const v = this.ring[(this.read + i) % this.cap];
        out[i] = v;
        ss += v * v;
      }
      if (k < n) out.fill(0, k);
      if (k > 0 && !this.firstSent) {
        this.firstSent = true;
        this.port.postMessage({type: 'first', frame: currentFrame, gen: this.gen});
      }
      this.read += k;
      this.played += k;
      this.sumsq += ss;
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
