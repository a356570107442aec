// Qwen3-TTS Live: the page's own streaming player (raw 24 kHz PCM, int16 little-endian, through Web Audio).
//
// How a run goes. A capture-phase click listener on the document sees a click on a Generate button
// (class `live-generate`) before Gradio does. Inside that click it resumes the AudioContext (browsers start audio
// only inside a user gesture) and makes an unguessable single-use token. Gradio's own click handler then runs the
// event, whose `js=` hook calls `liveTTS.takeToken(formValues, endpoint)`: the player starts
// `fetch("live/<token>?session=…&api=<endpoint>", {method: "POST", body: {data: formValues}})` at once, which
// starts the generation on the server without waiting for Gradio's round trip (ui/early_start.py), and the hook
// hands the token to Python as the event's last input, so the Gradio event reports on the same run. The hook
// hands it over only once the player has 0.2 s in hand (at most 500 ms later): Gradio's own work for the event
// (in the page and on the server) then does not compete with the first chunk. When the server may not start the
// run early it answers 202 at once, the hook hands the token over, and the player reads with a GET. (A hook
// without form values, `takeToken()`, or none within 60 ms: a plain `GET live/<token>` that waits for the Gradio
// event's handler.) Stop (class `live-stop`) aborts the fetch, which cancels the generation on the server, and
// silences the player at once.
//
// Two ways to play. Where AudioWorklet exists (secure contexts: HTTPS, localhost) an AudioWorkletNode with a
// ring buffer (live_player_worklet.js). Elsewhere (plain HTTP on a LAN address) scheduled
// AudioBufferSourceNodes. `?live_player=scheduled` in the page URL forces the second (for tests).
//
// Buffering. The player knows the generation rate r (audio seconds made per wall second): the server's recent
// rate (header X-Live-Rate) until it has measured this stream's own arrival rate, and then the typical rate of its
// last five chunks (a late chunk now and then is not believed, a stream that stays slow is; a slow start is
// forgotten as fast). It plans for r' = r / 1.2: when r' >= 1 it plays at once (with 0.3 s buffered first when
// r < 1.8), unless the next chunk (its size from X-Live-Chunks at the start, else twice the last) would come too
// late for what is buffered. Otherwise it waits ("buffering") until the buffer B
// covers the shortfall of the rest: B >= R (1/r' - 1), R the audio still to come (from X-Live-Expected-Seconds
// when the server sent it, else assumed as long as what came so far), plus a chunk. The first start also waits
// as long after the first byte as the chunks of this page's last runs came late for a start at their first byte
// (startDelay; nothing where they came in time). After an underrun it pauses and rebuffers the same way rather
// than stutter (metrics: underruns, stallMs, maxStallMs, startLagMs; timeline: [ms after the click, samples] of
// each chunk).
//
// Metrics for tests and the page: window.liveTTS.metrics (this run) and window.liveTTS.runs (all runs):
// clickToSoundMs (click to the first sample audible: its render time mapped to the page clock by
// ctx.getOutputTimestamp(), or render time + outputLatency), clickToFirstByteMs, underruns, samplesPlayed,
// rms (of the samples the player itself played), analyserRms (loudest 2048-sample window an AnalyserNode on the
// output saw), state (idle | buffering | playing | ended | stopped | error), backend (worklet | scheduled),
// maxSilenceMs (longest silence inside the stream's samples: below -60 dBFS, sound on both sides), stallMs (time
// spent rebuffering after underruns: silence the stream did not contain), longestGapMs (the longest silence heard:
// a silence inside the stream with the stalls at its edges, or a stall alone), longestJoinGapMs (the same at the
// silences inside the stream only: pauses between dialogue lines and sentence groups).
(() => {
  'use strict';
  if (window.liveTTS) return;
  const SR = 24000;
  const script = document.currentScript;
  // the route lives next to this script (…/live/player.js -> …/live/<token>)
  const BASE = script && script.src ? new URL('./', script.src).href : new URL('live/', location.href).href;
  const params = new URLSearchParams(location.search);
  const FORCE_SCHEDULED = params.get('live_player') === 'scheduled';
  const GEN_SEL = 'button.live-generate, .live-generate button';
  const STOP_SEL = 'button.live-stop, .live-stop button';
  // the worklet's ring holds this much; more waits on the page's side (`?live_ring_s=` for tests)
  const RING_SECONDS = Math.max(0.5, parseFloat(params.get('live_ring_s')) || 30);
  // plan for generation this much slower than measured: below RATE_SLACK x real time the player buffers first
  const RATE_SLACK = 1.2;
  const CUSHION_BELOW_RATE = 1.8, CUSHION_S = 0.3;
  // the stream's rate is the typical rate of its last this many chunks (rate)
  const RATE_INTERVALS = 5;
  // the start rule learns from this page's last runs how late their chunks came (startLag, over their first
  // LAG_WINDOW_S) and starts that much after the first byte, less LAG_TOLERATED_MS (at most MAX_START_LAG_MS)
  const LAG_WINDOW_S = 2.5, LAG_TOLERATED_MS = 50, MAX_START_LAG_MS = 1500, LAG_RUNS = 3;
  // The audio device's buffer: the smallest the browser allows (0). Chromium's 'interactive' is a 10 ms buffer and
  // ~42 ms from a rendered sample to the speaker at 24 kHz; the smallest halves that (~21 ms; ~11 ms at the
  // output's own rate, see CONTEXT_RATE). `?live_latency=`
  // ('interactive', 'balanced' or seconds) overrides it.
  const LATENCY = (() => {
    const v = params.get('live_latency');
    if (v == null || v === '') return 0;
    return isNaN(parseFloat(v)) ? v : parseFloat(v);
  })();
  // The AudioContext's sample rate: the output device's own where the worklet plays (it resamples the 24 kHz
  // stream), 24 kHz for the scheduled buffers. `?live_rate=24000` (or another rate) sets it (to compare).
  const CONTEXT_RATE = parseFloat(params.get('live_rate')) || null;
  // The click's Gradio event waits (in its js= hook) until the player has the first audio, at most this long: the
  // event's own work (the page's loading indicators, its request, the server's event handling) would otherwise
  // share the page's main thread and the server's CPU with the first chunk, which arrives ~30-100 ms later than
  // it could. The event only reports on a run the player's request started (ui/early_start.py).
  // "The first audio": this many seconds of it in the player's buffer, not yet played (the event's work on the main
  // thread and the server, ~40-100 ms, then falls where the player has that much in hand and does not make it run
  // dry; let go after the second chunk of one frame, with ~0.1 s in hand, it delayed the third chunk by ~80 ms and
  // the player ran dry).
  const HOLD_EVENT_MS = 500, HOLD_EVENT_S = 0.2;

  function token() {
    const b = new Uint8Array(16);
    crypto.getRandomValues(b);   // exists in insecure contexts too (crypto.randomUUID does not)
    return Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('');
  }

  // --- backends: where the samples go -------------------------------------------------------------------
  class WorkletBackend {
    constructor(ctx, dest, onEvent) {
      this.kind = 'worklet';
      this.ctx = ctx;
      this.onEvent = onEvent;
      this.node = new AudioWorkletNode(ctx, 'live-pcm-player', {numberOfInputs: 0, outputChannelCount: [1],
        processorOptions: {capacity: RING_SECONDS * SR, inRate: SR}});
      this.node.connect(dest);
      this.node.port.onmessage = (e) => this.onMessage(e.data);
      this.reset();
    }
    reset() {
      this.gen = (this.gen || 0) + 1;
      this.sent = 0; this.stats = {read: 0, played: 0, sumsq: 0, underruns: 0}; this.overflow = [];
      this.firstFrame = null; this.firstSeen = null;
      this.node.port.postMessage({type: 'reset', gen: this.gen});
    }
    onMessage(m) {
      if (m.gen !== this.gen) return;            // a message from before the last reset
      if (m.type === 'first') {
        this.firstFrame = m.frame; this.firstSeen = [performance.now(), this.ctx.currentTime];
        this.onEvent('first');
      } else if (m.type === 'stats') {
        this.stats = m;
        this.flush();
        if (m.event) this.onEvent(m.event);
      }
    }
    flush() {
      while (this.overflow.length
             && this.sent + this.overflow[0].length - this.stats.read <= Math.floor(RING_SECONDS * SR)) {
        const s = this.overflow.shift();
        this.sent += s.length;
        this.node.port.postMessage({type: 'push', samples: s}, [s.buffer]);
      }
    }
    push(f32) {
      const max = Math.floor(RING_SECONDS * SR / 4);   // pieces that always fit once the ring has drained a bit
      if (f32.length <= max) this.overflow.push(f32);
      else for (let i = 0; i < f32.length; i += max) this.overflow.push(f32.slice(i, i + max));
      this.flush();
    }
    play() { this.node.port.postMessage({type: 'play'}); }
    end() { this.node.port.postMessage({type: 'end'}); }
    clear() { this.overflow = []; this.reset(); }
    // Samples it can still play; `all`: counting those the worklet holds back while the stream goes on (its
    // resampler needs a few samples past the one it plays: `hold`), which it plays once the stream has ended.
    buffered(all) {
      const n = this.sent - this.stats.read + this.overflow.reduce((a, s) => a + s.length, 0);
      return all ? n : Math.max(0, n - (this.stats.hold || 0));
    }
    played() { return this.stats.played; }
    sumsq() { return this.stats.sumsq; }
    firstContextTime() { return this.firstFrame == null ? null : this.firstFrame / this.ctx.sampleRate; }
  }

  class ScheduledBackend {
    constructor(ctx, dest, onEvent) {
      this.kind = 'scheduled';
      this.ctx = ctx; this.dest = dest; this.onEvent = onEvent;
      this.timer = null;
      this.reset();
    }
    reset() {
      if (this.sources) for (const s of this.sources) { try { s.node.stop(); } catch (e) { /* not started */ } }
      this.sources = []; this.pending = []; this.playing = false; this.ended = false;
      this.nextTime = 0; this.donePlayed = 0; this.doneSumsq = 0; this.firstStart = null; this.firstSeen = null;
      this.firstReported = false;
      if (this.timer) { clearInterval(this.timer); this.timer = null; }
    }
    schedule() {
      const now = this.ctx.currentTime;
      if (this.nextTime < now + 0.005) this.nextTime = now + 0.01;   // (re)start just ahead of the clock
      while (this.pending.length) {
        const f32 = this.pending.shift();
        const buf = this.ctx.createBuffer(1, f32.length, SR);
        buf.copyToChannel(f32, 0);
        const node = this.ctx.createBufferSource();
        node.buffer = buf;
        node.connect(this.dest);
        node.start(this.nextTime);
        let ss = 0;
        for (let i = 0; i < f32.length; i++) ss += f32[i] * f32[i];
        this.sources.push({node, start: this.nextTime, end: this.nextTime + f32.length / SR, n: f32.length, ss});
        if (this.firstStart == null) { this.firstStart = this.nextTime; this.firstSeen = [performance.now(), now]; }
        this.nextTime += f32.length / SR;
      }
    }
    tick() {
      const now = this.ctx.currentTime;
      while (this.sources.length && this.sources[0].end <= now) {
        const s = this.sources.shift();
        this.donePlayed += s.n; this.doneSumsq += s.ss;
      }
      if (this.firstStart != null && !this.firstReported && now >= this.firstStart) {
        this.firstReported = true; this.onEvent('first');
      }
      if (this.playing && !this.sources.length && now >= this.nextTime) {
        this.playing = false;
        if (this.ended) { clearInterval(this.timer); this.timer = null; this.onEvent('ended'); }
        else this.onEvent('underrun');
      }
    }
    push(f32) { this.pending.push(f32); if (this.playing) this.schedule(); }
    play() {
      this.playing = true;
      this.schedule();
      if (!this.timer) this.timer = setInterval(() => this.tick(), 15);
    }
    end() { this.ended = true; if (!this.timer) this.timer = setInterval(() => this.tick(), 15); }
    clear() { this.reset(); }
    buffered() {
      const now = this.ctx.currentTime;
      let n = this.pending.reduce((a, s) => a + s.length, 0);
      for (const s of this.sources) n += Math.min(s.n, Math.max(0, (s.end - now) * SR));
      return n;
    }
    played() {
      const now = this.ctx.currentTime;
      let n = this.donePlayed;
      for (const s of this.sources) n += Math.min(s.n, Math.max(0, (now - s.start) * SR));
      return Math.round(n);
    }
    sumsq() {   // of the buffers fully played, plus the played part of the current one (at its mean power)
      const now = this.ctx.currentTime;
      let ss = this.doneSumsq;
      for (const s of this.sources) ss += s.ss * Math.min(1, Math.max(0, (now - s.start) * SR / s.n));
      return ss;
    }
    firstContextTime() { return this.firstStart; }
  }

  // --- the player ----------------------------------------------------------------------------------------
  class LivePlayer {
    constructor() {
      this.ctx = null; this.backend = null; this.ready = null; this.run = null; this.runs = [];
      this.metrics = {state: 'idle'};
      this.handoff = null;   // the token waiting for Gradio's js= hook
      this.lags = [];        // startLag (ms) of the last LAG_RUNS runs that played to their end
      this.holdEventMs = HOLD_EVENT_MS;   // 0: the Gradio event goes at once (benchmarks compare)
      this.holdEventS = HOLD_EVENT_S;
      document.addEventListener('click', (e) => this.onClick(e), true);
      // Any earlier gesture (pressing the button, typing the text) may already start the audio device, so that
      // the click itself does not wait for it (user activation: pointerdown and keydown count, as click does).
      const warm = () => { if (this.ctx && this.ctx.state === 'suspended') this.ctx.resume().catch(() => {}); };
      document.addEventListener('pointerdown', warm, true);
      document.addEventListener('keydown', warm, true);
      addEventListener('pagehide', () => this.stop('stopped'));
      this.netStarts = new Map();   // stream URL -> responseStart (an observer: the page's timing buffer may be full)
      try {
        new PerformanceObserver((list) => {
          let mine = false;
          for (const e of list.getEntries()) {
            if (!e.name.startsWith(BASE) || !(e.responseStart > 0)) continue;
            mine = true;
            this.netStarts.set(e.name, e.responseStart);
            if (this.netStarts.size > 50) this.netStarts.delete(this.netStarts.keys().next().value);
          }
          if (mine && this.run) this.publish();
        }).observe({type: 'resource'});
      } catch (e) { /* no Resource Timing: the metric stays null */ }
      this.prepare();
    }

    // An AudioContext (suspended until a click) and the worklet module, ahead of the first click.
    prepare() {
      if (this.ctx) return this.ready;
      const AC = window.AudioContext || window.webkitAudioContext;
      if (!AC) { this.ready = Promise.resolve(); return this.ready; }
      // With the worklet: a context at the output's own rate (the worklet resamples; a 24 kHz context makes the
      // browser resample behind it, ~10 ms more output latency). Without it: 24 kHz, so that the browser's own
      // resampler, not an AudioBufferSourceNode's interpolation, converts the stream's rate.
      const worklet = !FORCE_SCHEDULED && window.isSecureContext && !!window.AudioWorkletNode;
      const rate = CONTEXT_RATE || (worklet ? null : SR);
      for (const opts of [{sampleRate: rate, latencyHint: LATENCY}, {sampleRate: SR, latencyHint: 'interactive'},
        {latencyHint: 'interactive'}]) {   // the last: a resampling context (AudioBuffers at 24 kHz still play)
        if (opts.sampleRate == null) delete opts.sampleRate;
        try { this.ctx = new AC(opts); break; } catch (e) { /* next */ }
      }
      if (!this.ctx) { this.ready = Promise.resolve(); return this.ready; }
      this.analyser = this.ctx.createAnalyser();
      this.analyser.fftSize = 2048;
      this.analyser.connect(this.ctx.destination);
      const onEvent = (ev) => this.onBackendEvent(ev);
      const canWorklet = !FORCE_SCHEDULED && this.ctx.audioWorklet && window.AudioWorkletNode;
      if (!canWorklet) {
        this.backend = new ScheduledBackend(this.ctx, this.analyser, onEvent);
        this.ready = Promise.resolve();
      } else {
        this.ready = this.ctx.audioWorklet.addModule(new URL('worklet.js', BASE).href)
          .then(() => { this.backend = new WorkletBackend(this.ctx, this.analyser, onEvent); })
          .catch((err) => {
            console.warn('live player: AudioWorklet failed, using scheduled buffers', err);
            this.backend = new ScheduledBackend(this.ctx, this.analyser, onEvent);
          });
      }
      return this.ready;
    }

    active() { return !!this.run && (this.run.state === 'buffering' || this.run.state === 'playing'); }

    onClick(e) {
      const t = e.target;
      if (!t || !t.closest) return;
      if (t.closest(STOP_SEL)) { this.stop('stopped'); return; }
      const btn = t.closest(GEN_SEL);
      if (!btn || btn.disabled) return;
      if (this.active()) {                    // one run at a time: the second click goes nowhere (nor to Gradio)
        e.stopImmediatePropagation(); e.preventDefault();
        return;
      }
      this.start(e.timeStamp || performance.now(), btn.id || '');
    }

    // Called inside the click: resume the context, start the fetch, leave the token for Gradio's js= hook.
    start(clickTime, source) {
      this.prepare();
      if (this.ctx && this.ctx.state !== 'running') this.ctx.resume().catch(() => {});
      const tok = token();
      const run = {token: tok, source, clickTime, state: 'buffering', controller: new AbortController(),
        received: 0, chunks: 0, arrivals: [], maxStallMs: 0, firstByteAt: null, headersAt: null, rateHint: null,
        expected: null, plan: null, streamDone: false, serverDone: false, underruns: 0, carry: null, peakRms: 0, log: [],
        requestAt: null, early: false, timeline: [], startLag: 0, started: false,
        heard: false, pos: 0, silentRun: 0, maxSilentRun: 0, silences: [], stalls: [], stallMs: 0, stalledAt: null};
      this.stop('stopped');
      if (this.backend) this.backend.clear();   // nothing of the last run may count toward this one
      this.run = run;
      this.handoff = tok;
      this.publish();
      // the event's js= hook normally comes within a few ms with the form values; without it, read only
      run.fetchTimer = setTimeout(() => this.beginFetch(run, null, null), 60);
      return tok;
    }

    // Start the run's stream request (once): a POST with the form values (the server may start generating from
    // it), or a GET that waits for the Gradio event's handler.
    beginFetch(run, form, api) {
      if (run.requestAt != null || this.run !== run || run.state !== 'buffering') return;
      clearTimeout(run.fetchTimer);
      run.requestAt = performance.now();
      run.early = form != null && !!api;
      this.fetchRun(run, run.early ? form : null, api);
    }

    // What the output carries right now (tests: after Stop it must be silence): an AnalyserNode window's RMS and
    // the samples the backend has played in its current run.
    probe() {
      if (!this.analyser) return null;
      const buf = new Float32Array(this.analyser.fftSize);
      this.analyser.getFloatTimeDomainData(buf);
      let ss = 0;
      for (let i = 0; i < buf.length; i++) ss += buf[i] * buf[i];
      return {outputRms: Math.sqrt(ss / buf.length), backendPlayed: this.backend ? this.backend.played() : 0,
        backendBuffered: this.backend ? this.backend.buffered() : 0, contextTime: this.ctx.currentTime};
    }

    // Gradio's js= hook: the token of the click that triggered this event (once). `form` (the event's input
    // values, without the token) and `api` (its endpoint) go with the stream request, which may then start the
    // generation before the Gradio event reaches the server. Then the token comes as a promise that the player
    // keeps until it has the first audio (`holdEvent`).
    takeToken(form, api) {
      const t = this.handoff || '';
      this.handoff = null;
      const run = this.run;
      if (t && run && run.token === t) {
        let ok = Array.isArray(form) && typeof api === 'string';
        if (ok) { try { JSON.stringify(form); } catch (e) { ok = false; } }
        this.beginFetch(run, ok ? form : null, ok ? api : null);
        if (run.early && this.holdEventMs > 0) return this.holdEvent(run, t);
      }
      return t;
    }

    // The token, once the first audio is in the player, the stream ended or failed, the server declined to start
    // early (the event must then start the run), or `holdEventMs` passed, whichever comes first.
    holdEvent(run, t) {
      return new Promise((resolve) => {
        run.release = () => {
          if (run.releasedAt != null) return;
          run.releasedAt = performance.now();
          clearTimeout(run.holdTimer);
          resolve(t);
        };
        run.holdTimer = setTimeout(run.release, this.holdEventMs);
      });
    }

    // The Gradio event finished (a JS-only .then()): a run that never got a response is over.
    serverDone() {
      const run = this.run;
      if (!run) return;
      run.serverDone = true;
      setTimeout(() => {
        if (this.run === run && run.headersAt == null && run.state === 'buffering') this.finish(run, 'idle');
      }, 3000);
    }

    async fetchRun(run, form, api) {
      const session = window.__gradio_session_hash__ || '';
      const url = new URL(run.token, BASE);
      url.searchParams.set('session', session);
      const init = {signal: run.controller.signal, cache: 'no-store'};
      if (form) {
        url.searchParams.set('api', api);
        init.method = 'POST';
        init.headers = {'Content-Type': 'application/json'};
        init.body = JSON.stringify({data: form});
      }
      run.url = url.href;
      const pending = fetch(url.href, init);   // sent before anything else: the server starts generating now
      pending.catch(() => {});
      await this.ready;
      if (this.run !== run) { run.controller.abort(); return; }
      this.backend.clear();
      let resp;
      try {
        resp = await pending;
        if (form && resp.status === 202) {   // not started early: read what the Gradio event's run makes
          run.early = false;
          if (run.release) run.release();
          url.searchParams.delete('api');
          run.url = url.href;
          resp = await fetch(url.href, {signal: run.controller.signal, cache: 'no-store'});
        }
      } catch (err) {
        if (this.run === run && !run.controller.signal.aborted) this.finish(run, 'error', String(err));
        return;
      }
      run.headersAt = performance.now();
      if (!resp.ok) {
        // 404: no stream for this click; 422: its input was refused (the Gradio event shows why)
        this.finish(run, resp.status === 404 || resp.status === 422 ? 'idle' : 'error', 'HTTP ' + resp.status);
        return;
      }
      run.rateHint = parseFloat(resp.headers.get('X-Live-Rate')) || null;
      run.expected = parseFloat(resp.headers.get('X-Live-Expected-Seconds')) || null;
      run.plan = (resp.headers.get('X-Live-Chunks') || '').split(',').map((x) => Math.round(parseFloat(x) * SR))
        .filter((n) => n > 0);
      const reader = resp.body.getReader();
      try {
        for (;;) {
          const {value, done} = await reader.read();
          if (this.run !== run) return;
          if (done) break;
          this.onBytes(run, value);
        }
      } catch (err) {
        if (this.run === run && !run.controller.signal.aborted) this.finish(run, 'error', String(err));
        return;
      }
      run.streamDone = true;
      if (run.release) run.release();
      this.backend.end();
      if (run.received === 0) { this.finish(run, 'ended'); return; }
      this.decide(run);
    }

    onBytes(run, bytes) {
      if (run.firstByteAt == null) run.firstByteAt = performance.now();
      let b = bytes;
      if (run.carry != null) {                  // an odd byte left from the last chunk
        const m = new Uint8Array(b.length + 1); m[0] = run.carry; m.set(b, 1); b = m; run.carry = null;
      }
      if (b.length % 2) { run.carry = b[b.length - 1]; b = b.subarray(0, b.length - 1); }
      const n = b.length / 2;
      if (!n) return;
      const dv = new DataView(b.buffer, b.byteOffset, b.length);
      const f = new Float32Array(n);
      for (let i = 0; i < n; i++) f[i] = dv.getInt16(2 * i, true) / 32768;
      this.countSilence(run, f);
      // one engine chunk may come in several network reads: reads a few ms apart count as one chunk
      const now = performance.now();
      if (run.chunks > 0 && now - run.lastByteAt < 8) {
        run.lastChunk += n;
        if (run.chunks === 1) run.firstChunkSamples += n;
        run.arrivals[run.arrivals.length - 1][1] += n;
        if (run.timeline.length && run.timeline.length < 400) run.timeline[run.timeline.length - 1][1] += n;
      } else {
        run.chunks += 1;
        run.lastChunk = n;
        if (run.chunks === 1) run.firstChunkSamples = n;
        run.arrivals.push([now, n]);             // [when the chunk came, its samples]
        // how late this chunk came for a start at the first byte: it arrived this long after the audio before it
        // would have played out
        if (now - run.firstByteAt <= LAG_WINDOW_S * 1000) {
          run.startLag = Math.max(run.startLag, now - run.firstByteAt - run.received / SR * 1000);
        }
        if (run.timeline.length < 400) run.timeline.push([Math.round(now - run.clickTime), n]);
        if (run.arrivals.length > RATE_INTERVALS + 1) run.arrivals.shift();
      }
      run.maxChunk = Math.max(run.maxChunk || 0, run.lastChunk);
      run.received += n;
      run.lastByteAt = now;
      this.backend.push(f);
      this.decide(run);
      // the first audio is in the player: the Gradio event may go now
      if (run.release && this.backend.buffered() >= this.holdEventS * SR) run.release();
    }

    // Silence inside the stream (a dialogue's pauses, gaps between sentence groups): runs of samples below -60 dBFS
    // with sound on both sides (leading and trailing silence do not count), kept as [first, end) sample positions.
    countSilence(run, f) {
      for (let i = 0; i < f.length; i++, run.pos++) {
        if (f[i] < 1e-3 && f[i] > -1e-3) { run.silentRun += 1; continue; }
        if (run.heard && run.silentRun > 0) {
          run.maxSilentRun = Math.max(run.maxSilentRun, run.silentRun);
          if (run.silentRun >= 24) run.silences.push([run.pos - run.silentRun, run.pos]);
        }
        run.heard = true;
        run.silentRun = 0;
      }
    }

    // The longest silence the listener heard (ms): a silence inside the stream plus the rebuffering stalls at its
    // edges or within it (joins only: the pauses of a dialogue, between sentence groups), or also a stall on its
    // own (all).
    longestGap(run, joinsOnly) {
      const slack = 240;   // 10 ms: a stall this close to a silence joins it
      let best = 0;
      const joined = new Set();
      for (const [a, b] of run.silences) {
        let ms = (b - a) / SR * 1000;
        run.stalls.forEach(([pos, d], k) => { if (pos >= a - slack && pos <= b + slack) { ms += d; joined.add(k); } });
        best = Math.max(best, ms);
      }
      if (!joinsOnly) run.stalls.forEach(([, d], k) => { if (!joined.has(k)) best = Math.max(best, d); });
      return best;
    }

    // Audio seconds generated per wall second: measured on this stream once it has two chunks, else the server's
    // recent rate, else unknown (null). Measured: the typical rate of the stream's last RATE_INTERVALS chunks, each
    // chunk's audio over the time since the chunk before it (their median, the upper one of an even count: a late
    // chunk now and then - a moment of a busy CPU - does not make the player wait for a slow stream, a stream that
    // stays slow does); while the stream is young (under 1.5 s) the server's rate counts as one more of them. Not the stream's average: after a slow start (the click's own work
    // in the browser and the server) the average stays low for long, and a player that believed it would wait
    // seconds to rebuffer audio that in fact comes several times faster than it plays.
    rate(run) {
      const a = run.arrivals;
      const now = run.streamDone ? run.lastByteAt : performance.now();
      if (a.length >= 2 && now - run.firstByteAt >= 150) {
        const rates = [];
        for (let i = Math.max(1, a.length - RATE_INTERVALS); i < a.length; i++) {
          rates.push(a[i][1] / SR / Math.max((a[i][0] - a[i - 1][0]) / 1000, 0.005));
        }
        if (run.rateHint != null && now - run.firstByteAt < 1500) rates.push(run.rateHint);
        rates.sort((x, y) => x - y);
        return rates[Math.floor(rates.length / 2)];
      }
      if (run.rateHint == null && run.underruns > 0) {   // it ran dry before a second chunk: judge from the click
        return run.received / SR / ((performance.now() - run.clickTime) / 1000);
      }
      return run.rateHint;
    }

    // The buffer (seconds) needed so that playback, once started, reaches the end without a gap ("can play
    // through"), planning for generation RATE_SLACK times slower than measured (contention comes and goes).
    needed(run) {
      const r = this.rate(run);
      if (r == null) return 0;
      const rp = Math.max(r / RATE_SLACK, 0.05);
      // fast enough to play through, but with little to spare (under 1.8x real time): start with a small cushion
      // against the jitter of a busy CPU; well ahead of real time: at once
      if (rp >= 1) return r < CUSHION_BELOW_RATE ? CUSHION_S : 0;
      const got = run.received / SR;
      // (an expectation that proves short - more audio came than expected - is no longer trusted)
      const rest = run.expected != null && got < 0.9 * run.expected ? Math.max(run.expected - got, 1.0)
        : Math.max(got * (run.expected != null ? 0.5 : 1), 2.0);
      // + one chunk's wait: audio comes in chunks, so the next one may land up to a chunk interval late
      return rest * (1 / rp - 1) + 0.2 + (run.maxChunk || 0) / SR / rp;
    }

    decide(run) {
      if (this.run !== run || run.state !== 'buffering') return;
      const b = this.backend.buffered() / SR;
      const left = this.backend.buffered(true);
      if (run.streamDone && left <= 0) { this.finish(run, 'ended'); return; }   // ran dry exactly at the end
      run.need = this.needed(run);
      if ((b > 0 || (run.streamDone && left > 0)) && (run.streamDone || b >= run.need)) {
        let wait = run.streamDone ? 0 : this.waitForNextChunk(run, b);
        if (!run.started && !run.streamDone) wait = Math.max(wait, this.startDelay(run));
        if (wait > 0) {                       // the next chunk would come too late for what is buffered now
          clearTimeout(run.waitTimer);
          run.waitTimer = setTimeout(() => this.decide(run), wait);
        } else {
          run.log.push([Math.round(performance.now() - run.clickTime), 'play', +b.toFixed(3), +run.need.toFixed(3)]);
          run.state = 'playing';
          run.started = true;
          if (run.stalledAt != null) {        // the end of a rebuffer: how long the listener heard nothing
            const d = performance.now() - run.stalledAt;
            run.stallMs += d;
            run.maxStallMs = Math.max(run.maxStallMs, d);
            run.stalls.push([run.stalledPos, d]);
            run.stalledAt = null;
          }
          this.backend.play();
          this.watchRms(run);
        }
      }
      this.publish();
    }

    // Milliseconds to wait before the first start, learnt from this page's last runs: their chunks came up to
    // startLag ms later than a start at their first byte could play them without a gap (the click's own work in the
    // browser and the server, other lines or clients in the engine, a busy CPU slow down a stream's first seconds
    // most), so this run starts that much after its first byte, less LAG_TOLERATED_MS (a pause that short is
    // accepted rather than a later first sound); nothing on a page whose streams came in time. 0 or less: now.
    startDelay(run) {
      if (!this.lags.length) return 0;
      const lag = Math.min(Math.max(...this.lags), MAX_START_LAG_MS) - LAG_TOLERATED_MS;
      return run.firstByteAt + lag - performance.now();
    }

    // Milliseconds to wait before starting so that the buffer lasts until the next chunks arrive: at rate r each
    // lands (the audio made since the last one / r) after it, give or take some jitter. The next chunks: the rest of
    // the server's plan of a stream's first chunks (X-Live-Chunks: 1, 1, 2, 4, 8, 12 frames; within the expected
    // length), else one guessed twice the last. Chunks that double in size at about 2x real time leave almost no
    // slack at each step (each takes as long to make as the audio before it lasts), so the whole plan counts, not
    // only the next chunk. 0: start now.
    waitForNextChunk(run, buffered) {
      const r = this.rate(run);
      if (r == null) return 0;
      const now = performance.now(), rr = Math.max(r, 0.05);
      let made = 0, ahead = buffered, wait = -Infinity;
      for (const n of this.nextChunks(run)) {
        made += n;
        const arrives = run.lastByteAt + (made / SR / rr) * 1000 * 1.1 + 25;
        wait = Math.max(wait, arrives - now - ahead * 1000);
        ahead += n / SR;
      }
      return Math.min(wait, 1000);
    }

    // Samples of the chunks that come next. The server says how large a part's first chunks are (X-Live-Chunks),
    // which counts where the samples so far end exactly at one of them (the rest of the plan, as far as the
    // expected length goes); otherwise chunks tend to grow (the engine doubles them: 2, 4, 8, 12 frames), so the
    // next one is guessed twice the last.
    nextChunks(run) {
      let end = 0;
      const plan = run.plan || [];
      for (let k = 0; k < plan.length; k++) {
        if (end === run.received) {
          const rest = [], limit = run.expected != null ? run.expected * SR : Infinity;
          for (let j = k; j < plan.length && end < limit; j++) { rest.push(plan[j]); end += plan[j]; }
          if (rest.length) return rest;
          break;
        }
        end += plan[k];
        if (end > run.received) break;
      }
      return [Math.min(2 * run.lastChunk, SR)];
    }

    onBackendEvent(ev) {
      const run = this.run;
      if (!run) return;
      if (ev === 'first') this.firstSound(run);
      else if (ev === 'underrun' && run.state === 'playing') {
        run.underruns += 1; run.state = 'buffering';
        run.stalledAt = performance.now(); run.stalledPos = this.backend.played();
        run.log.push([Math.round(performance.now() - run.clickTime), 'underrun', run.received / SR]);
        this.decide(run);
      } else if (ev === 'ended' && run.state === 'playing') this.finish(run, 'ended');
      this.publish();
    }

    firstSound(run) {
      const t0 = this.backend.firstContextTime();
      if (t0 == null || run.soundAt != null) return;
      // rendered: when the first sample went through the graph (the context clock mapped to the page clock
      // through a (page time, context time) pair the backend noted when it learnt of that sample)
      const [seenPerf, seenCtx] = this.backend.firstSeen || [performance.now(), this.ctx.currentTime];
      run.renderedAt = seenPerf + (t0 - seenCtx) * 1000;
      const lat = (this.ctx.outputLatency || 0) + (this.ctx.baseLatency || 0);
      let audible = run.renderedAt + lat * 1000;
      run.soundVia = 'outputLatency';
      const ts = this.ctx.getOutputTimestamp ? this.ctx.getOutputTimestamp() : null;
      if (ts && ts.performanceTime > 0 && ts.contextTime > 0) {
        const viaTs = ts.performanceTime + (t0 - ts.contextTime) * 1000;
        if (viaTs >= run.clickTime && viaTs < run.renderedAt + 1000) {
          audible = Math.max(viaTs, run.renderedAt);
          run.soundVia = 'getOutputTimestamp';
        }
      }
      run.soundAt = audible;
      this.publish();
    }

    watchRms(run) {
      if (run.rmsTimer) return;
      const buf = new Float32Array(this.analyser.fftSize);
      run.rmsTimer = setInterval(() => {
        if (this.run !== run || run.state === 'stopped') { clearInterval(run.rmsTimer); return; }
        this.analyser.getFloatTimeDomainData(buf);
        let ss = 0;
        for (let i = 0; i < buf.length; i++) ss += buf[i] * buf[i];
        run.peakRms = Math.max(run.peakRms, Math.sqrt(ss / buf.length));
        this.publish();
      }, 50);
    }

    finish(run, state, error) {
      if (state === 'ended' && run.state !== 'ended' && run.firstByteAt != null) {
        this.lags.push(run.startLag);
        if (this.lags.length > LAG_RUNS) this.lags.shift();
      }
      run.state = state;
      if (run.release) run.release();
      if (state !== 'ended') run.controller.abort();   // (a no-op once the response is complete)
      if (error) run.error = error;
      if (run.rmsTimer) setTimeout(() => clearInterval(run.rmsTimer), state === 'ended' ? 200 : 0);
      this.publish();
    }

    stop(state) {
      const run = this.run;
      this.handoff = null;
      if (!run) return;
      if (run.state === 'buffering' || run.state === 'playing') {
        run.controller.abort();
        if (this.backend) { run.finalPlayed = this.backend.played(); run.finalSumsq = this.backend.sumsq(); }
        if (this.backend) this.backend.clear();
        this.finish(run, state);
      }
    }

    // When the network stack had the stream's first byte (Resource Timing, known once the response is complete),
    // against the click; clickToFirstByteMs is when the page's main thread read it.
    responseStart(run) {
      const t = run.url ? this.netStarts.get(run.url) : null;
      return t ? t - run.clickTime : null;
    }

    publish() {
      const run = this.run;
      if (!run) return;
      const be = this.backend;
      const played = run.finalPlayed != null ? run.finalPlayed : (be ? be.played() : 0);
      const ss = run.finalSumsq != null ? run.finalSumsq : (be ? be.sumsq() : 0);
      const m = {
        token: run.token.slice(0, 6), state: run.state, backend: be ? be.kind : null,
        secureContext: window.isSecureContext, contextState: this.ctx ? this.ctx.state : null,
        clickToRequestMs: run.requestAt != null ? run.requestAt - run.clickTime : null, early: run.early,
        clickToHeadersMs: run.headersAt != null ? run.headersAt - run.clickTime : null,
        clickToFirstByteMs: run.firstByteAt != null ? run.firstByteAt - run.clickTime : null,
        clickToResponseStartMs: this.responseStart(run),
        clickToEventMs: run.releasedAt != null ? run.releasedAt - run.clickTime : null,
        clickToRenderedMs: run.renderedAt != null ? run.renderedAt - run.clickTime : null,
        clickToSoundMs: run.soundAt != null ? run.soundAt - run.clickTime : null,
        contextRate: this.ctx ? this.ctx.sampleRate : null,
        outputLatencyMs: this.ctx ? ((this.ctx.outputLatency || 0) + (this.ctx.baseLatency || 0)) * 1000 : null,
        underruns: run.underruns, maxStallMs: Math.round(run.maxStallMs), samplesReceived: run.received, samplesPlayed: played,
        secondsPlayed: played / SR, rms: played ? Math.sqrt(ss / played) : 0, analyserRms: run.peakRms,
        rate: run.firstByteAt != null ? this.rate(run) : run.rateHint, rateHint: run.rateHint, neededBufferS: run.need || 0,
        soundVia: run.soundVia || null, expectedSeconds: run.expected, streamDone: run.streamDone,
        error: run.error || null,
        maxSilenceMs: run.maxSilentRun / SR * 1000, stallMs: run.stallMs, longestGapMs: this.longestGap(run, false),
        longestJoinGapMs: this.longestGap(run, true),
        startLagMs: Math.round(run.startLag), log: run.log, timeline: run.timeline,
      };
      this.metrics = m;
      const i = this.runs.findIndex((x) => x.token === m.token);
      if (i >= 0) this.runs[i] = m; else this.runs.push(m);
      this.render(m);
    }

    render(m) {
      let el = document.getElementById('live-player-status');
      if (!el) return;
      const ms = m.clickToSoundMs != null ? ` · click → sound ${Math.round(m.clickToSoundMs)} ms` : '';
      const under = m.underruns ? ` · ${m.underruns} rebuffer${m.underruns > 1 ? 's' : ''}` : '';
      const text = {buffering: 'buffering…', playing: 'playing', ended: 'played', stopped: 'stopped',
        idle: '', error: 'live player: ' + (m.error || 'error')}[m.state] || m.state;
      el.textContent = text ? `🔊 ${text}${ms}${under}` : '';
      el.dataset.state = m.state;
    }
  }

  window.liveTTS = new LivePlayer();
})();
