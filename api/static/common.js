// Shared dashboard helpers: the API key (localStorage), authenticated fetch, SSE over fetch, formatting.
const GSPO = (() => {
  const keyName = "gspo_api_key";
  const getKey = () => localStorage.getItem(keyName) || "";
  const setKey = (k) => localStorage.setItem(keyName, k.trim());

  async function api(path, opts = {}) {
    const headers = Object.assign({ Authorization: "Bearer " + getKey() }, opts.headers || {});
    if (opts.json !== undefined) { headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(opts.json); }
    const resp = await fetch(path, Object.assign({}, opts, { headers }));
    if (!resp.ok) {
      let msg = resp.status + " " + resp.statusText;
      try { const e = (await resp.json()).error; msg = e.message + (e.field ? ` [${e.field}${e.line ? ", line " + e.line : ""}]` : ""); } catch (_) {}
      throw new Error(msg);
    }
    const type = resp.headers.get("content-type") || "";
    return type.includes("json") ? resp.json() : resp;
  }

  // EventSource cannot send an Authorization header, so SSE is read from a streamed fetch.
  async function events(path, onEvent, signal) {
    let lastId = "";
    for (;;) {
      try {
        const resp = await fetch(path, { headers: { Authorization: "Bearer " + getKey(), "Last-Event-ID": lastId }, signal });
        if (!resp.ok) throw new Error("events: " + resp.status);
        const reader = resp.body.getReader(); const dec = new TextDecoder(); let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += dec.decode(value, { stream: true });
          let i;
          while ((i = buf.indexOf("\n\n")) >= 0) {
            const block = buf.slice(0, i); buf = buf.slice(i + 2);
            let ev = "message", data = "", id = null;
            for (const line of block.split("\n")) {
              if (line.startsWith("event: ")) ev = line.slice(7);
              else if (line.startsWith("data: ")) data += line.slice(6);
              else if (line.startsWith("id: ")) id = line.slice(4);
            }
            if (id) lastId = id;
            if (data) { onEvent(ev, JSON.parse(data)); if (ev === "end") return; }
          }
        }
      } catch (e) { if (signal && signal.aborted) return; }
      await new Promise((r) => setTimeout(r, 2000));  // reconnect, resuming from Last-Event-ID
    }
  }

  function keyBox() {
    const box = document.getElementById("key-box");
    if (!box) return;
    box.innerHTML = '<input id="api-key" type="password" placeholder="API key" size="28"><button id="save-key" class="secondary">Use key</button>';
    document.getElementById("api-key").value = getKey();
    document.getElementById("save-key").onclick = () => { setKey(document.getElementById("api-key").value); location.reload(); };
  }

  // Small magnitudes in exponent notation: fixed decimals would show a learning rate of 5e-6 as "0.000".
  const fmt = (x, d = 3) => (x === null || x === undefined || Number.isNaN(x)) ? "–" : (Math.abs(x) >= 1000 ? x.toFixed(0) : (x !== 0 && Math.abs(x) < 10 ** -d) ? x.toExponential(2) : x.toFixed(d));
  const when = (s) => s ? new Date(s).toLocaleString() : "–";
  const duration = (a, b) => { if (!a) return "–"; const s = ((b ? new Date(b) : new Date()) - new Date(a)) / 1000; return s < 90 ? s.toFixed(0) + " s" : (s / 60).toFixed(1) + " min"; };
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  // A step's headline number: the mean reward of a reinforcement job, the loss of a supervised one.
  const headline = (m) => ("reward/mean" in m ? { name: "reward", value: m["reward/mean"] } : { name: "loss", value: m.loss });
  document.addEventListener("DOMContentLoaded", keyBox);
  return { api, events, getKey, setKey, fmt, when, duration, esc, headline };
})();
