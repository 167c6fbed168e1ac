// Jobs list (with reward or, for supervised jobs, loss sparklines) and the new-job form.
(() => {
  const DEFAULT_REWARD = { type: "string_check", name: "correct", input: "{{sample.output_text}}", reference: "{{item.answer}}", operation: "eq" };
  const DEFAULT_HP = { steps: 20, prompts_per_step: 8, group_size: 8, max_new_tokens: 64, learning_rate: 1e-5 };
  const GSPO_DEFAULTS = "defaults: clip_eps_low 3e-4, clip_eps_high 4e-4, mini_batches 4, loss gspo, advantage group_norm, beta 0, old_logprobs auto";

  function sparkline(values) {
    if (!values.length) return "";
    const w = 90, h = 22, lo = Math.min(...values), hi = Math.max(...values), span = hi - lo || 1;
    const pts = values.map((v, i) => `${(i / Math.max(1, values.length - 1)) * w},${h - ((v - lo) / span) * (h - 2) - 1}`).join(" ");
    return `<svg class="spark" width="${w}" height="${h}"><polyline fill="none" stroke="#2f6fed" stroke-width="1.5" points="${pts}"/></svg>`;
  }

  async function loadJobs() {
    const status = document.getElementById("status-filter").value;
    const tbody = document.getElementById("jobs");
    try {
      const page = await GSPO.api("/v1/jobs?limit=100" + (status ? "&status=" + status : ""));
      const rows = await Promise.all(page.data.map(async (j) => {
        const m = await GSPO.api(`/v1/jobs/${j.id}/metrics?limit=10000`).catch(() => ({ data: [] }));
        const points = m.data.map((r) => GSPO.headline(r.metrics)).filter((h) => h.value !== undefined);
        const values = points.map((h) => h.value);
        const last = values.length ? `${GSPO.fmt(values[values.length - 1])}${points[0].name === "loss" ? " loss" : ""}` : "–";
        return `<tr data-job="${j.id}"><td><a href="/jobs/${j.id}">${GSPO.esc(j.name || j.id)}</a></td><td>${GSPO.esc(j.model)}</td>
          <td><span class="status ${j.status}">${j.status}</span></td><td>${j.step}/${j.total_steps}</td>
          <td>${last} ${sparkline(values)}</td><td>${GSPO.when(j.created_at)}</td><td>${GSPO.duration(j.started_at, j.finished_at)}</td></tr>`;
      }));
      tbody.innerHTML = rows.join("") || '<tr><td colspan="7" class="muted">no jobs yet</td></tr>';
      document.getElementById("jobs-error").textContent = "";
    } catch (e) { document.getElementById("jobs-error").textContent = e.message; }
    document.body.dataset.jobsReady = "1";
  }

  function parseJson(id, what) {
    try { return JSON.parse(document.getElementById(id).value || "{}"); } catch (e) { throw new Error(`${what}: ${e.message}`); }
  }

  async function testGrader() {
    const out = document.getElementById("nj-test-out");
    try {
      const res = await GSPO.api("/v1/rewards/run", { method: "POST", json: {
        reward: parseJson("nj-reward", "reward spec"), item: parseJson("nj-item", "item"),
        samples: [document.getElementById("nj-sample").value] } });
      out.textContent = JSON.stringify(res.results[0], null, 2); out.className = "";
    } catch (e) { out.textContent = e.message; out.className = "error"; }
  }

  async function submit() {
    const err = document.getElementById("nj-error"); err.textContent = "";
    try {
      const file = document.getElementById("nj-file").files[0];
      if (!file) throw new Error("choose a JSONL dataset");
      const form = new FormData(); form.append("file", file);
      const uploaded = await GSPO.api("/v1/files", { method: "POST", body: form });
      const job = await GSPO.api("/v1/jobs", { method: "POST", json: {
        model: document.getElementById("nj-model").value, training_file: uploaded.id,
        name: document.getElementById("nj-name").value || null,
        reward: parseJson("nj-reward", "reward spec"), hyperparameters: parseJson("nj-hp", "hyperparameters") } });
      location.href = "/jobs/" + job.id;
    } catch (e) { err.textContent = e.message; }
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.getElementById("nj-reward").value = JSON.stringify(DEFAULT_REWARD, null, 2);
    document.getElementById("nj-hp").value = JSON.stringify(DEFAULT_HP, null, 2);
    document.getElementById("nj-defaults").textContent = GSPO_DEFAULTS;
    document.getElementById("status-filter").onchange = loadJobs;
    document.getElementById("nj-test").onclick = testGrader;
    document.getElementById("nj-submit").onclick = submit;
    loadJobs();
    setInterval(loadJobs, 5000);
  });
})();
