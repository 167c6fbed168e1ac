// One job, live: charts from SSE metrics, held-out evaluation before → after, environment, rollout inspector,
// checkpoints, events, cancel, config.
(() => {
  const jobId = location.pathname.split("/").pop();
  const steps = [], rows = [];  // rows[i] = metrics of steps[i]
  let job = null;

  const col = (name) => rows.map((m) => (name in m ? m[name] : null));
  const CHARTS = [
    ["reward", "Reward (mean ± std)", () => [{ label: "reward", values: col("reward/mean"),
      band: [rows.map((m) => m["reward/mean"] - m["reward/std"]), rows.map((m) => m["reward/mean"] + m["reward/std"])] }]],
    ["graders", "Reward per grader", () => Object.keys(rows[rows.length - 1] || {}).filter((k) => /^reward\/.+\/mean$/.test(k))
      .map((k) => ({ label: k.split("/")[1], values: col(k) }))],
    ["zero_std", "Groups with zero reward std", () => [{ label: "frac_zero_std", values: col("reward/frac_zero_std") }]],
    ["clip", "Clip fractions", () => [{ label: "low", values: col("clip/low_frac") }, { label: "high", values: col("clip/high_frac") }]],
    ["ratio", "Importance ratio", () => ["mean", "min", "max"].map((k) => ({ label: k, values: col("ratio/" + k) }))],
    ["gap", "|trainer − sampler| logprob gap", () => ["mean", "max"].map((k) => ({ label: k, values: col("logprob_gap/" + k) }))],
    ["entropy", "Entropy", () => [{ label: "entropy", values: col("entropy") }]],
    ["length", "Completion length", () => [{ label: "mean", values: col("completion/len_mean") }, { label: "max", values: col("completion/len_max") }]],
    ["trunc", "Truncated fraction", () => [{ label: "truncated", values: col("completion/truncated_frac") }]],
    ["grad", "Gradient norm", () => [{ label: "grad_norm", values: col("grad_norm") }]],
    ["lr", "Learning rate", () => [{ label: "lr", values: col("lr") }]],
    ["eval", "Eval reward", () => [{ label: "sampled", values: col("eval/reward/mean") },
      { label: "greedy", values: col("eval/greedy/reward/mean") }]],
    ["loss", "Loss", () => [{ label: "train", values: col("loss") }, { label: "validation", values: col("eval/loss") }]],
    ["time", "Time per phase (s, stacked)", () => Charts.stacked(["rollout", "reward", "old_logprobs", "train", "weight_sync"]
      .map((k) => ({ label: k, values: col("time/" + k) })))],
    ["tps", "Tokens / s", () => [{ label: "tokens/s", values: col("throughput/tokens_per_s") }]],
  ];

  function drawCharts() {
    const host = document.getElementById("charts");
    const smooth = parseFloat(document.getElementById("smooth").value);
    for (const [id, title, build] of CHARTS) {
      let el = document.getElementById("chart-" + id);
      if (!el) { el = document.createElement("div"); el.className = "chart"; el.id = "chart-" + id; host.appendChild(el); }
      const series = rows.length ? build() : [];
      // A chart none of whose metrics the job reports (a supervised job has no reward) is left out.
      el.hidden = rows.length > 0 && !series.some((s) => s.values.some((v) => v !== null && v !== undefined));
      if (!el.hidden) Charts.draw(el, title, steps, series, { smooth });
    }
    document.body.dataset.points = String(steps.length);
  }

  function addMetrics(step, metrics) {
    if (steps.length && step <= steps[steps.length - 1]) return false;
    steps.push(step); rows.push(metrics);
    return true;
  }

  function logEvent(kind, data) {
    const box = document.getElementById("events");
    const line = document.createElement("div");
    line.textContent = `${GSPO.when(data.created_at)}  [${kind}] ${data.message}`;
    box.appendChild(line); box.scrollTop = box.scrollHeight;
  }

  function showJob() {
    document.getElementById("job-title").textContent = job.name || job.id;
    const st = document.getElementById("job-status"); st.textContent = job.status; st.className = "status " + job.status;
    const waiting = job.waiting_reason ? ` · ${job.waiting_reason}` : "";
    const used = job.usage && job.usage.device_seconds ? ` · ${(job.usage.device_seconds / 60).toFixed(1)} device-min` : "";
    document.getElementById("job-progress").textContent = `step ${job.step}/${job.total_steps} · ${job.model}${used}${waiting}`;
    document.getElementById("job-error").textContent = job.error || "";
    document.getElementById("cancel").disabled = !["queued", "running", "pausing", "paused"].includes(job.status);
    document.getElementById("ckpt-metric").textContent = job.hyperparameters.method === "supervised" ? "Loss" : "Reward";
    showEvaluation();
    document.getElementById("config").textContent = JSON.stringify({ model: job.model, training_file: job.training_file,
      validation_file: job.validation_file, environment: job.environment, seed: job.seed, reward: job.reward, hyperparameters: job.hyperparameters,
      metadata: job.metadata }, null, 2);
  }

  // "before → after" of each number the held-out evaluation has (greedy and sampled reward, or a loss).
  const EVAL_NAMES = [["greedy_reward", "greedy reward"], ["sampled_reward", "sampled reward"], ["loss", "loss"]];
  function showEvaluation() {
    const ev = job.evaluation || {}, box = document.getElementById("evaluation-box");
    box.hidden = !ev.before && !ev.after;
    if (box.hidden) return;
    const point = ev.after || ev.before;
    document.getElementById("evaluation").innerHTML = EVAL_NAMES.filter(([k]) => point[k] !== null && point[k] !== undefined)
      .map(([k, label]) => `<div class="eval-line" data-name="${k}"><b>${label}</b> ${ev.before ? GSPO.fmt(ev.before[k]) : "–"} → ${ev.after ? GSPO.fmt(ev.after[k]) : "…"}</div>`)
      .join("") + `<div class="muted">${point.prompts} held-out prompts; before step 1 and after step ${ev.after ? ev.after.step : job.total_steps}</div>`;
  }

  async function loadEnvironment() {
    const box = document.getElementById("environment-box");
    box.hidden = !job.environment;
    if (!job.environment || box.dataset.loaded) return;
    const env = await GSPO.api(`/v1/jobs/${jobId}/environment?samples=3`);
    document.getElementById("environment").textContent = JSON.stringify(env.environment, null, 2);
    // An OpenEnv server's rows are reset seeds: each episode's first message is the server's reset observation.
    const row = env.environment.type === "openenv"
      ? (item) => `<b>reset seed ${GSPO.esc(String(item.seed))}</b>
      <span class="muted">played on the server: its reset observation is the first message</span>`
      : (item) => `<b>${GSPO.esc(item.task || "")}</b> <code>${GSPO.esc(item.question || JSON.stringify(item.messages))}</code>
      <span class="muted">answer ${GSPO.esc(String(item.answer))}</span>`;
    document.getElementById("environment-samples").innerHTML = env.samples.map(
      (item) => `<div class="sample">${row(item)}</div>`).join("");
    box.dataset.loaded = "1";
  }

  async function refresh() {
    job = await GSPO.api(`/v1/jobs/${jobId}`); showJob();
    await loadEnvironment(); await loadCheckpoints(); await loadSampleSteps();
  }

  // A checkpoint's held-out number against the evaluation before training (greedy reward, else the sampled one).
  function heldOut(m) {
    const before = (job.evaluation || {}).before;
    const key = "eval/greedy/reward/mean" in m ? ["eval/greedy/reward/mean", "greedy_reward"] : ["eval/reward/mean", "sampled_reward"];
    if (!(key[0] in m)) return '<span class="muted">–</span>';
    return `${before && before[key[1]] !== null ? GSPO.fmt(before[key[1]]) + " → " : ""}${GSPO.fmt(m[key[0]])}`;
  }

  async function loadCheckpoints() {
    const list = (await GSPO.api(`/v1/jobs/${jobId}/checkpoints`)).data;
    document.getElementById("checkpoints").innerHTML = list.map((c) => `<tr><td>${c.step}${c.final ? " (final)" : ""}</td>
      <td>${GSPO.fmt(GSPO.headline(c.metrics).value)}</td><td>${heldOut(c.metrics)}</td><td>${(c.size_bytes / 1e6).toFixed(2)} MB</td><td>${GSPO.when(c.created_at)}</td>
      <td><a href="#" class="download" data-id="${c.id}" data-name="${jobId}-step-${c.step}.tar.gz">download</a></td></tr>`).join("")
      || '<tr><td colspan="6" class="muted">no checkpoint yet</td></tr>';
    document.querySelectorAll("a.download").forEach((a) => a.onclick = async (e) => {
      e.preventDefault();
      const resp = await GSPO.api(`/v1/checkpoints/${a.dataset.id}/download`);
      const url = URL.createObjectURL(await resp.blob());
      const link = document.createElement("a"); link.href = url; link.download = a.dataset.name; document.body.appendChild(link);
      link.click(); link.remove(); setTimeout(() => URL.revokeObjectURL(url), 10000);
    });
  }

  async function loadSampleSteps() {
    let info; try { info = await GSPO.api(`/v1/jobs/${jobId}/samples`); } catch (_) { return; }
    const sel = document.getElementById("sample-step"); const current = sel.value;
    sel.innerHTML = info.steps_available.map((s) => `<option>${s}</option>`).join("");
    sel.value = current && info.steps_available.includes(+current) ? current : String(info.step);
    if (!current) showSamples(info);
  }

  function showSamples(info) {
    document.getElementById("sample-info").textContent = `${info.rows.length} prompts`;
    document.getElementById("samples").innerHTML = info.rows.map((r) => `<div class="sample"><b>Prompt:</b> <code>${GSPO.esc(r.prompt)}</code>
      <span class="muted">item ${GSPO.esc(JSON.stringify(r.item))}</span>${r.completions.map((c) => {
        const errs = Object.entries(c.errors || {}).map(([g, e]) => `<div class="error">${GSPO.esc(g)}: ${GSPO.esc(e)}</div>`).join("");
        const scores = Object.entries(c.scores || {}).map(([g, s]) => `${GSPO.esc(g)}=${GSPO.fmt(s)}`).join(" ");
        return `<div class="completion ${errs ? "err" : c.reward > 0.5 ? "good" : ""}"><b>${GSPO.fmt(c.reward)}</b> ${GSPO.esc(c.text)}
          <span class="muted">[${scores}; ${c.tokens} tok, ${c.finish_reason}]</span>${errs}</div>`; }).join("")}</div>`).join("");
    document.body.dataset.samplesReady = "1";
  }

  document.addEventListener("DOMContentLoaded", async () => {
    document.getElementById("smooth").oninput = drawCharts;
    document.getElementById("sample-step").onchange = async (e) => showSamples(await GSPO.api(`/v1/jobs/${jobId}/samples?step=${e.target.value}`));
    document.getElementById("cancel").onclick = async () => { job = await GSPO.api(`/v1/jobs/${jobId}/cancel`, { method: "POST" }); showJob(); };
    try { await refresh(); } catch (e) { document.getElementById("job-error").textContent = e.message; return; }
    const past = (await GSPO.api(`/v1/jobs/${jobId}/metrics?limit=100000`)).data;
    past.forEach((r) => addMetrics(r.step, r.metrics));
    drawCharts();
    document.body.dataset.chartsReady = "1";
    let pending = null;
    GSPO.events(`/v1/jobs/${jobId}/events`, (kind, data) => {
      if (kind === "metrics") {
        if (addMetrics(data.step, data.metrics)) pending = pending || setTimeout(() => { pending = null; drawCharts(); }, 300);
      } else if (kind === "end") { refresh().then(() => { document.body.dataset.streamEnded = "1"; }); }
      else { logEvent(kind, data); if (kind !== "log") refresh(); }
    });
  });
})();
