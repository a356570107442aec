// Replay (not a test): feed recorded chunk arrivals to the page's player logic (assets/live_player.js, or another
// version of it) on a virtual clock, and print when it started and how it rebuffered. Two versions of the player
// compared on the very same arrivals: the difference is the start/rebuffer rule alone, not the machine's load.
//
//   node tests/player_replay.js PLAYER.js [PLAYER2.js ...] < runs.json
//
// runs.json: {"hint": 2.6, "expected": 7.9, "runs": [[[ms after the click, ms of audio], ...], ...]}: the chunks as
// the player's `timeline` metric records them (ms of audio = samples / 24); a run may also be an object {"hint",
// "expected", "chunks", "plan"} (tests/stream_gaps.py --timelines writes them so; "plan": the X-Live-Chunks header,
// ms of audio of the first chunks). Each run is replayed on a fresh page
// ("fresh"), and again after the same run played once on that page ("after one like it": the page's own history).
// Output latency and the audio device are left out: "start" is when the player decided to play.
'use strict';
const fs = require('fs');

const SR = 24000;

function load(path) {
  const clock = {now: 0};
  const timers = [];
  let ids = 0;
  const win = {};
  const env = {
    window: win,
    document: {currentScript: null, addEventListener() {}, getElementById() { return null; }},
    location: {href: 'http://replay/', search: ''},
    performance: {now: () => clock.now},
    setTimeout: (fn, ms) => { const id = ++ids; timers.push({at: clock.now + Math.max(0, ms || 0), fn, id}); return id; },
    clearTimeout: (id) => { const i = timers.findIndex((t) => t.id === id); if (i >= 0) timers.splice(i, 1); },
    setInterval: () => 0, clearInterval: () => {}, addEventListener: () => {},
    crypto: {getRandomValues: (b) => b}, URL, URLSearchParams, console,
  };
  new Function(...Object.keys(env), fs.readFileSync(path, 'utf8'))(...Object.values(env));
  const player = win.liveTTS;
  player.analyser = {fftSize: 4, getFloatTimeDomainData() {}};
  player.backend = new SimBackend(clock, timers, (ev) => player.onBackendEvent(ev));
  return {player, clock, timers};
}

// Plays what it is given at real time from play() on; runs dry -> 'underrun' (or 'ended' after end()).
class SimBackend {
  constructor(clock, timers, onEvent) { this.kind = 'sim'; this.clock = clock; this.timers = timers; this.onEvent = onEvent; this.reset(); }
  reset() { this.pushed = 0; this.base = 0; this.since = null; this.ended = false; this.dry = null; }
  clear() { this.reset(); }
  played() {
    if (this.since == null) return this.base;
    return Math.min(this.pushed, this.base + Math.floor((this.clock.now - this.since) / 1000 * SR));
  }
  buffered() { return this.pushed - this.played(); }
  sumsq() { return 0; }
  firstContextTime() { return null; }
  push(f32) { this.pushed += f32.length; this.schedule(); }
  play() { if (this.since == null) { this.base = this.played(); this.since = this.clock.now; } this.schedule(); }
  end() { this.ended = true; this.schedule(); }
  schedule() {
    if (this.since == null) return;
    if (this.dry) { const i = this.timers.indexOf(this.dry); if (i >= 0) this.timers.splice(i, 1); }
    this.dry = {at: this.since + (this.pushed - this.base) / SR * 1000, id: -1, fn: () => {
      this.dry = null;
      if (this.buffered() > 0) return;
      this.base = this.pushed; this.since = null;
      this.onEvent(this.ended ? 'ended' : 'underrun');
    }};
    this.timers.push(this.dry);
  }
}

function replay(sim, chunks, hint, expected, plan) {
  const {player, clock, timers} = sim;
  clock.now += 60000;                       // a new click, a minute later
  const click = clock.now;
  player.start(click, 'replay');
  const run = player.run;
  clearTimeout(run.fetchTimer);
  timers.splice(0, timers.length);
  run.requestAt = run.headersAt = click;
  run.rateHint = hint; run.expected = expected;
  run.plan = plan ? plan.map((ms) => Math.round(ms * SR / 1000)) : null;   // X-Live-Chunks (ms of audio each)
  const arrivals = chunks.map(([t, ms]) => [click + t, Math.round(ms * SR / 1000)]);
  let k = 0;
  for (;;) {
    timers.sort((a, b) => a.at - b.at);
    const nextArrival = k < arrivals.length ? arrivals[k][0] : Infinity;
    const nextTimer = timers.length ? timers[0].at : Infinity;
    if (nextArrival === Infinity && nextTimer === Infinity) break;
    if (nextArrival <= nextTimer) {
      clock.now = nextArrival;
      const n = arrivals[k][1];
      const bytes = new Uint8Array(2 * n);
      for (let i = 1; i < bytes.length; i += 2) bytes[i] = 0x10;   // not silence
      player.onBytes(run, bytes);
      k += 1;
      if (k === arrivals.length) { run.streamDone = true; player.backend.end(); player.decide(run); }
    } else {
      clock.now = nextTimer;
      timers.shift().fn();
    }
    if (clock.now - click > 120000) break;
  }
  const first = run.log.find((e) => e[1] === 'play');
  return {start: first ? first[0] : null, underruns: run.underruns, stallMs: Math.round(run.stallMs),
          maxStallMs: Math.round(run.maxStallMs), state: run.state};
}

function main() {
  const paths = process.argv.slice(2);
  const spec = JSON.parse(fs.readFileSync(0, 'utf8'));
  console.log('| player | run | fresh page: start (ms) | rebuffers | silence in them (ms) | after one like it: start (ms) '
              + '| rebuffers | silence in them (ms) |');
  console.log('|---|---|---|---|---|---|---|---|');
  for (const path of paths) {
    spec.runs.forEach((r, i) => {
      const chunks = Array.isArray(r) ? r : r.chunks;
      const hint = Array.isArray(r) ? spec.hint : r.hint, expected = Array.isArray(r) ? spec.expected : r.expected;
      const plan = (Array.isArray(r) ? null : r.plan) || spec.plan;
      const fresh = replay(load(path), chunks, hint, expected, plan);
      const sim = load(path);
      replay(sim, chunks, hint, expected, plan);
      const again = replay(sim, chunks, hint, expected, plan);
      const f = (r) => `${r.start} | ${r.underruns} | ${r.stallMs} (max ${r.maxStallMs})`;
      console.log(`| ${path} | ${i + 1} | ${f(fresh)} | ${f(again)} |`);
    });
  }
}

main();
