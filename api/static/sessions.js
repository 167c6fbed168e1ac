// The tenant's Tinker sessions beside its jobs: state, model, steps, queued requests, usage and last activity.
(() => {
  async function loadSessions() {
    const tbody = document.getElementById("sessions");
    try {
      const page = await GSPO.api("/v1/sessions?limit=50");
      tbody.innerHTML = page.data.map((x) => {
        const state = x.status === "active" ? "running" : "cancelled";  // the jobs' colours: live, ended
        const title = x.closed_reason ? ` title="${GSPO.esc(x.closed_reason)}"` : "";
        return `<tr data-session="${GSPO.esc(x.id)}"><td>${GSPO.esc(x.id)}</td><td>${GSPO.esc(x.base_models.join(", ") || "–")}</td>
          <td><span class="status ${state}"${title}>${GSPO.esc(x.status)}</span></td><td>${x.steps}</td><td>${x.pending}</td>
          <td>${GSPO.fmt(x.device_seconds, 1)} s</td><td>${x.tokens_sampled} / ${x.tokens_trained}</td><td>${GSPO.when(x.last_activity_at)}</td></tr>`;
      }).join("") || '<tr><td colspan="8" class="muted">no sessions yet (the Tinker SDK opens them)</td></tr>';
      document.getElementById("sessions-error").textContent = "";
    } catch (e) { document.getElementById("sessions-error").textContent = e.message; }
    document.body.dataset.sessionsReady = "1";
  }

  document.addEventListener("DOMContentLoaded", () => { loadSessions(); setInterval(loadSessions, 5000); });
})();
