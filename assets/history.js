// Qwen3-TTS Live: A/B listening of the session's takes (ui/history.py renders each take with a native <audio>
// element, id `take-audio-<n>`, and two buttons, A and B, that choose it for the comparison).
//
// "▶ A" plays take A and "▶ B" plays take B, one button each. Switching while one plays continues the other at the
// same position (so the same words are compared); pressing the playing one again pauses it. Any take's own player
// pauses every other take when it starts. State for tests: window.takesAB.state
// {a, b, playing ('A' | 'B' | null), take (the take number playing), at (its position, s)}.
(() => {
  'use strict';
  if (window.takesAB) return;

  const audioOf = (n) => (n == null ? null : document.getElementById('take-audio-' + n));

  class TakesAB {
    constructor() {
      this.state = {a: null, b: null, playing: null, take: null, at: 0};
      document.addEventListener('click', (e) => this.onClick(e));
      // one take at a time: a player that starts pauses the others (capture: media events do not bubble)
      document.addEventListener('play', (e) => this.onPlay(e), true);
      document.addEventListener('pause', () => this.refresh(), true);
      document.addEventListener('ended', () => this.refresh(), true);
    }

    onClick(e) {
      const t = e.target && e.target.closest ? e.target.closest('.take-ab, .takes-play') : null;
      if (!t) return;
      e.preventDefault();
      if (t.classList.contains('take-ab')) this.choose(t.dataset.slot, parseInt(t.dataset.take, 10));
      else this.play(t.dataset.slot);
    }

    choose(slot, n) {
      if (slot === 'A') this.state.a = n; else this.state.b = n;
      this.refresh();
    }

    // Play A or B; from the position of the other one if that one is playing (or was paused mid-way).
    play(slot) {
      const n = slot === 'A' ? this.state.a : this.state.b;
      const el = audioOf(n);
      if (!el) return;
      if (this.state.playing === slot && !el.paused) { el.pause(); return; }
      const otherN = slot === 'A' ? this.state.b : this.state.a;
      const other = audioOf(otherN);
      let at = 0;
      if (other && other !== el && other.currentTime > 0 && !other.ended) at = other.currentTime;
      for (const a of document.querySelectorAll('audio[id^="take-audio-"]')) if (a !== el) a.pause();
      // (before its metadata is loaded, a position set now is where it starts)
      if (at > 0 && !(isFinite(el.duration) && at >= el.duration)) el.currentTime = at;
      else if (el.ended) el.currentTime = 0;
      this.state.playing = slot;
      const p = el.play();
      if (p && p.catch) p.catch((err) => { this.state.error = String(err); this.refresh(); });
      this.refresh();
    }

    onPlay(e) {
      const el = e.target;
      if (!el || !el.id || !el.id.startsWith('take-audio-')) return;
      for (const a of document.querySelectorAll('audio[id^="take-audio-"]')) if (a !== el) a.pause();
      const n = parseInt(el.id.slice('take-audio-'.length), 10);
      if (n !== this.state.a && n !== this.state.b) this.state.playing = null;
      this.refresh();
    }

    refresh() {
      const s = this.state;
      let playingEl = null;
      for (const a of document.querySelectorAll('audio[id^="take-audio-"]')) if (!a.paused) playingEl = a;
      s.take = playingEl ? parseInt(playingEl.id.slice('take-audio-'.length), 10) : null;
      s.at = playingEl ? playingEl.currentTime : 0;
      if (!playingEl) s.playing = null;
      for (const b of document.querySelectorAll('.take-ab')) {
        const n = parseInt(b.dataset.take, 10);
        b.classList.toggle('chosen', (b.dataset.slot === 'A' ? s.a : s.b) === n);
      }
      for (const b of document.querySelectorAll('.takes-play')) {
        const slot = b.dataset.slot;
        const n = slot === 'A' ? s.a : s.b;
        const label = b.querySelector('.takes-which');
        if (label) label.textContent = n == null ? '(choose a take)' : `take #${n}`;
        b.classList.toggle('playing', s.playing === slot);
      }
    }
  }

  window.takesAB = new TakesAB();
})();
