// Qwen3-TTS Live: the Listen tab's trial player (ui/listen_tab.py renders a trial: a button `.ls-stim` and an
// <audio id="ls-audio-<label>"> per hidden label, a loop, and the answer controls).
//
// A stimulus button plays that stimulus from where the one playing (or last paused) is, so the same words are
// compared; pressing the playing one again pauses it. The loop (from / to, in seconds; "here" takes the current
// position) repeats that region of whichever stimulus plays. `answer()` is what Submit sends: the chosen label
// (A/B, ABX) or a JSON object label -> score (MUSHRA). State for tests: window.listenTest.state
// {playing (label | null), at (its position, s), loops (times the loop jumped back)}.
(() => {
  'use strict';
  if (window.listenTest) return;

  const $ = (id) => document.getElementById(id);
  const audios = () => Array.from(document.querySelectorAll('audio.ls-audio'));
  const num = (id) => { const el = $(id); const v = el ? parseFloat(el.value) : NaN; return isFinite(v) ? v : 0; };

  class ListenTest {
    constructor() {
      this.state = {playing: null, at: 0, loops: 0, trial: null};
      this.last = null;    // the element heard last (its position is where the next one starts)
      document.addEventListener('click', (e) => this.onClick(e));
      document.addEventListener('input', (e) => this.onInput(e));
      document.addEventListener('timeupdate', (e) => this.onTime(e), true);
      document.addEventListener('pause', () => this.refresh(), true);
      document.addEventListener('ended', () => this.refresh(), true);
      setInterval(() => this.tick(), 40);   // a tighter loop than timeupdate's ~250 ms
    }

    onClick(e) {
      const t = e.target && e.target.closest ? e.target.closest('.ls-stim, #ls-pause, #ls-loop-set-a, #ls-loop-set-b') : null;
      if (!t) return;
      e.preventDefault();
      if (t.id === 'ls-pause') { for (const a of audios()) a.pause(); return; }
      if (t.id === 'ls-loop-set-a' || t.id === 'ls-loop-set-b') {
        const el = this.current();
        const box = $(t.id === 'ls-loop-set-a' ? 'ls-loop-a' : 'ls-loop-b');
        if (el && box) box.value = el.currentTime.toFixed(2);
        return;
      }
      this.play(t.dataset.label);
    }

    onInput(e) {
      const el = e.target;
      if (el && el.classList && el.classList.contains('ls-score')) {
        const out = $(el.id + '-v');
        if (out) out.textContent = el.value;
      }
    }

    current() {
      const playing = audios().find((a) => !a.paused);
      return playing || (this.last && document.body.contains(this.last) ? this.last : null);
    }

    play(label) {
      const el = $('ls-audio-' + label);
      if (!el) return;
      const trial = $('ls-trial');
      const trialId = trial ? trial.dataset.test + ':' + trial.dataset.trial : null;
      if (trialId !== this.state.trial) { this.last = null; this.state.trial = trialId; }
      if (this.state.playing === label && !el.paused) { el.pause(); return; }
      const from = this.current();
      let at = 0;
      if (from && from !== el && from.currentTime > 0 && !from.ended) at = from.currentTime;
      else if (from === el && !el.ended) at = el.currentTime;
      for (const a of audios()) if (a !== el) a.pause();
      const loop = this.loop();
      if (loop && (at < loop[0] || at >= loop[1])) at = loop[0];
      if (!(isFinite(el.duration) && at >= el.duration)) el.currentTime = at; else el.currentTime = 0;
      this.last = el;
      this.state.playing = label;
      const p = el.play();
      if (p && p.catch) p.catch((err) => { this.state.error = String(err); this.refresh(); });
      this.refresh();
    }

    loop() {
      const on = $('ls-loop-on');
      const a = num('ls-loop-a'), b = num('ls-loop-b');
      return on && on.checked && b > a ? [a, b] : null;
    }

    onTime(e) { if (e.target && e.target.classList && e.target.classList.contains('ls-audio')) this.tick(); }

    tick() {
      const el = audios().find((a) => !a.paused);
      const loop = this.loop();
      if (el && loop && (el.currentTime >= loop[1] || el.currentTime < loop[0] - 0.05)) {
        el.currentTime = loop[0];
        this.state.loops += 1;
      }
      const pos = $('ls-pos');
      if (pos && el) pos.textContent = el.currentTime.toFixed(1) + ' s';
      if (el) this.state.at = el.currentTime;
    }

    refresh() {
      const el = audios().find((a) => !a.paused);
      this.state.playing = el ? el.id.slice('ls-audio-'.length) : null;
      this.state.at = el ? el.currentTime : (this.last ? this.last.currentTime : 0);
      for (const b of document.querySelectorAll('.ls-stim')) b.classList.toggle('playing', b.dataset.label === this.state.playing);
    }

    answer() {
      const trial = $('ls-trial');
      if (!trial) return '';
      if (trial.dataset.kind === 'mushra') {
        const out = {};
        for (const s of document.querySelectorAll('.ls-score')) out[s.dataset.label] = parseFloat(s.value);
        return JSON.stringify(out);
      }
      const chosen = document.querySelector('input[name="ls-choice"]:checked');
      return chosen ? chosen.value : '';
    }
  }

  window.listenTest = new ListenTest();
})();
