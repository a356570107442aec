// Qwen3-TTS Live: the page's "models ready" indicator. The server loads its models in the background while it
// already serves the page (ui/model_loader.py); this polls `live/models` while anything loads and writes the
// one-line summary ("⏳ Loading the CustomVoice model: step 1/2 …", then "✅ Models ready: …") into #model-state.
// window.liveModels: the last answer (for tests: {ready, loading, roles, summary}).
(() => {
  'use strict';
  if (window.liveModels !== undefined) return;
  window.liveModels = null;
  const script = document.currentScript;
  const BASE = script && script.src ? new URL('./', script.src).href : new URL('live/', location.href).href;
  const URL_ = new URL('models', BASE).href;

  function render() {
    const el = document.getElementById('model-state');
    const s = window.liveModels;
    if (!el || !s) return false;
    el.textContent = s.summary || '';
    el.dataset.ready = s.ready ? 'true' : 'false';
    el.dataset.loading = s.loading ? 'true' : 'false';
    return true;
  }

  async function poll() {
    let delay = 500;
    try {
      const r = await fetch(URL_, {cache: 'no-store'});
      if (r.ok) window.liveModels = await r.json();
    } catch (e) {
      delay = 2000;                              // the server restarts, or the network is away: try again later
    }
    const shown = render();
    if (window.liveModels && !window.liveModels.loading && shown) {
      // nothing loads any more: keep the text; check again now and then (a role may be queued later)
      setTimeout(poll, 30000);
      return;
    }
    setTimeout(poll, delay);
  }
  poll();
})();
