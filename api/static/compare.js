// Overlay the reward curves of several jobs (aligned by step).
(() => {
  const cache = {};
  async function draw() {
    const ids = [...document.getElementById("job-select").selectedOptions].map((o) => o.value);
    const series = [];
    for (const id of ids) {
      cache[id] = cache[id] || (await GSPO.api(`/v1/jobs/${id}/metrics?limit=100000`)).data;
      series.push({ id, rows: cache[id] });
    }
    const maxStep = Math.max(0, ...series.map((s) => s.rows.length ? s.rows[s.rows.length - 1].step : 0));
    const steps = Array.from({ length: maxStep }, (_, i) => i + 1);
    const lines = series.map((s) => {
      const by = Object.fromEntries(s.rows.map((r) => [r.step, r.metrics["reward/mean"]]));
      return { label: document.querySelector(`option[value="${s.id}"]`).textContent, values: steps.map((st) => by[st] ?? null) };
    });
    Charts.draw(document.getElementById("compare-chart"), "Reward mean", steps, lines, { smooth: parseFloat(document.getElementById("smooth").value) });
    document.body.dataset.compareReady = String(lines.length);
  }
  document.addEventListener("DOMContentLoaded", async () => {
    const jobs = (await GSPO.api("/v1/jobs?limit=200")).data;
    const sel = document.getElementById("job-select");
    sel.innerHTML = jobs.map((j) => `<option value="${j.id}">${GSPO.esc(j.name || j.id)}</option>`).join("");
    const wanted = new URLSearchParams(location.search).get("jobs");
    const pick = wanted ? wanted.split(",") : jobs.slice(0, 3).map((j) => j.id);
    [...sel.options].forEach((o) => { o.selected = pick.includes(o.value); });
    sel.onchange = draw; document.getElementById("smooth").oninput = draw;
    draw();
  });
})();
