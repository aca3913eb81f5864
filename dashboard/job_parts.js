// The parts of the job page (job.js puts them together and feeds them): the header with the
// job's actions, the progress card, the metric charts, the events, the checkpoints and the spec
// (the rollout viewer is rollouts.js). Each builds its elements once and returns them (`el`)
// with what the page calls to update them; `st` is the page's state, shared with them.

import { AuthError, api, qs } from "/dashboard/api.js";
import { StepChart, alignSeries, fmtNum } from "/dashboard/charts.js";
import { TERMINAL, badge, fmtDuration, fmtTime, graderNames, h, klText, progressBar } from "/dashboard/dom.js";
import { renderSpec } from "/dashboard/spec.js";

const CHARTS = [
  { key: "reward", title: "Reward", names: (spec) => ["reward/mean", ...graderNames(spec).map((g) => `reward/${g}/mean`)],
    label: (n) => (n === "reward/mean" ? "total" : n.split("/")[1]) },
  { key: "grader_errors", title: "Grader errors (samples scored 0)",
    names: (spec) => graderNames(spec).map((g) => `reward/${g}/errors`),
    label: (n) => n.split("/")[1] },
  { key: "kl", title: "KL to the reference", names: () => ["kl", "kl_k3"] },
  { key: "entropy", title: "Entropy", names: () => ["entropy"] },
  { key: "mismatch", title: "Sampler vs trainer",
    names: () => ["mismatch/kl", "mismatch/capped_frac", "mismatch/token_mult_prob_error"],
    label: (n) => n.split("/")[1] },
  // Async jobs (grpo.async.max_staleness >= 1): how old the trained samples were (versions)
  // and how busy the rollout server and the update kept each other.
  { key: "async", title: "Async: staleness and busy fractions",
    names: () => ["async/staleness_mean", "async/staleness_max", "async/rollout_busy_frac", "async/update_busy_frac"],
    label: (n) => n.split("/")[1] },
  { key: "clip", title: "Clip fraction", names: () => ["clip_frac/low", "clip_frac/high", "clip_frac/dual", "clip_frac/clamped"],
    label: (n) => n.split("/")[1] },
  { key: "length", title: "Completion length (tokens)", names: () => ["completion_len/mean", "completion_len/max"],
    label: (n) => n.split("/")[1] },
  { key: "truncated", title: "Truncated fraction", names: () => ["truncated_frac"] },
  { key: "time", title: "Step time breakdown (s, stacked)", stacked: true,
    names: () => ["time/rollout", "time/reward", "time/logprobs", "time/update", "time/weight_sync"],
    label: (n) => n.split("/")[1] },
];

/** The title, status badge and meta line, with the cancel, pause and resume buttons.
 * `act(action)` posts "cancel", "pause" or "resume" and shows the job it answers; when a pause
 * or a resume fails, `restore()` shows the buttons the last loaded job allows again. */
export function headerPart(id, { act, restore }) {
  const title = h("h2", { id: "job-title" }, id);
  const status = h("span", { id: "job-status" });
  const cancel = h("button", { id: "cancel-job", class: "danger", onclick: onCancel }, "Cancel job");
  const pauseBtn = h("button", { id: "pause-job", onclick: () => onControl("pause") }, "Pause");
  const resumeBtn = h("button", { id: "resume-job", onclick: () => onControl("resume") }, "Resume");
  const meta = h("div", { class: "meta muted small" });
  const el = h("div", { class: "job-head" }, h("div", {}, h("a", { href: "#/", class: "small" }, "← Jobs"), title, meta),
    h("span", { class: "spacer" }), status, pauseBtn, resumeBtn, cancel);

  async function onCancel() {
    if (!confirm(`Cancel job ${id}? A running job stops within one step and keeps its last checkpoint.`)) return;
    cancel.disabled = true;
    try {
      await act("cancel");
    } catch (err) {
      if (!(err instanceof AuthError)) alert(`Cancel failed: ${err.message}`);
      cancel.disabled = false;
    }
  }

  async function onControl(action) {
    pauseBtn.disabled = resumeBtn.disabled = true;
    try {
      await act(action);
    } catch (err) {
      if (!(err instanceof AuthError)) alert(`${action} failed: ${err.message}`);
      restore();
    }
  }

  function render(job) {
    title.textContent = job.name || job.id;
    document.title = `${job.name || job.id} · grpo-service`;
    status.replaceChildren(badge(job.status));
    cancel.disabled = TERMINAL.has(job.status) || job.status === "cancelling";
    // Pause while it queues or runs; resume once paused (or to take back a pause under way).
    pauseBtn.disabled = !["queued", "running"].includes(job.status);
    resumeBtn.disabled = !["paused", "pausing"].includes(job.status);
    meta.replaceChildren(
      h("span", { class: "mono" }, job.id), " · ", h("span", { class: "mono" }, job.model),
      " · KL ", klText(job.spec), " · created ", fmtTime(job.created_at));
  }

  return { el, render };
}

/** The progress bar and the job's figures: ETA, elapsed time, last reward, heartbeat, attempt, devices. */
export function progressPart() {
  const el = h("div", { class: "card progress", id: "job-progress" });
  function render(job) {
    const p = job.progress;
    const elapsed = job.started_at ? ((job.finished_at ? Date.parse(job.finished_at) : Date.now()) - Date.parse(job.started_at)) / 1000 : null;
    const stat = (label, value, idAttr) => h("div", { class: "stat" }, h("div", { class: "muted small" }, label), h("div", { class: "value", id: idAttr }, value));
    el.replaceChildren(
      h("div", { class: "progress-line" }, progressBar(p.step, p.total_steps),
        h("span", { id: "job-step" }, `step ${p.step} of ${p.total_steps}`)),
      h("div", { class: "stats" },
        stat("ETA", TERMINAL.has(job.status) ? "done" : fmtDuration(p.eta_s), "job-eta"),
        stat("Elapsed", fmtDuration(elapsed)),
        stat("Reward (last step)", fmtNum(p.last_metrics?.["reward/mean"])),
        stat("Heartbeat", p.heartbeat_age_s == null ? "–" : `${fmtDuration(p.heartbeat_age_s)} ago`),
        stat("Attempt", `${job.attempt} of ${job.max_attempts}`),
        stat("Devices", String(job.devices ?? 1)),
        stat("Finished", fmtTime(job.finished_at))),
      job.error ? h("p", { class: "error" }, `${job.error.code}: ${job.error.message || ""}`) : "");
  }
  return { el, render };
}

/** The metric charts (CHARTS), and one more for any other metric, picked from a list; `draw()`
 * draws `st.series`, and lists `st.available`. `stop()` stops following the page's width. */
export function chartsPart(st) {
  const el = h("div", { class: "charts", id: "charts" });
  const charts = CHARTS.map((c) => ({ def: c, chart: new StepChart(el, { key: c.key, title: c.title, stacked: c.stacked }) }));
  const extraSelect = h("select", { id: "extra-metric", onchange: draw });
  const extra = new StepChart(el, { key: "extra", title: "Any metric" });
  extra.title.after(" ", extraSelect);
  const resize = new ResizeObserver(() => { for (const c of charts) c.chart.resize(); extra.resize(); });
  resize.observe(el);

  function draw() {
    const spec = st.job?.spec;
    const emptyText = st.metricStep ? "Not recorded for this job." : "No data yet.";
    for (const { def, chart } of charts) {
      const names = def.names(spec);
      const { steps, columns } = alignSeries(st.series, names);
      const series = names.map((n, i) => ({ label: def.label ? def.label(n) : n, values: columns[i] }));
      chart.update(steps, series, emptyText);
    }
    const shown = new Set(CHARTS.flatMap((c) => c.names(spec)));
    const others = st.available.filter((n) => !shown.has(n));
    if (others.join() !== [...extraSelect.options].map((o) => o.value).join()) {
      const keep = extraSelect.value;
      extraSelect.replaceChildren(...others.map((n) => h("option", { value: n }, n)));
      if (others.includes(keep)) extraSelect.value = keep;
      else if (others.includes("grad_norm")) extraSelect.value = "grad_norm";
    }
    const name = extraSelect.value;
    const { steps, columns } = alignSeries(st.series, name ? [name] : []);
    extra.update(steps, name ? [{ label: name, values: columns[0] }] : []);
  }

  return { el, draw, stop: () => resize.disconnect() };
}

/** The job's events, newest first: `add(event)` from the stream, `load(signal)` what came
 * after the last one shown (`st.eventsAfter`). */
export function eventsPart(id, st) {
  const rows = h("tbody");
  const el = h("section", { class: "card" }, h("h3", {}, "Events"),
    h("div", { class: "scroll" }, h("table", { class: "events", id: "events" },
      h("thead", {}, h("tr", {}, ["Time", "Type", "Message"].map((t) => h("th", {}, t)))), rows)));

  /** One job event as a row at the top of the table; an event already shown is skipped. */
  function add(e) {
    if (st.eventsAfter != null && e.id <= st.eventsAfter) return;
    rows.prepend(h("tr", { class: `lvl-${e.level}` },
      h("td", { class: "small nowrap", title: fmtTime(e.created_at) }, new Date(e.created_at).toLocaleTimeString()),
      h("td", {}, h("span", { class: "tag" }, e.type)),
      h("td", {}, e.message)));
    st.eventCount += 1;
    st.eventsAfter = e.id;
  }

  async function load(signal) {
    for (;;) {
      const body = await api(`/v1/jobs/${encodeURIComponent(id)}/events?${qs({ after: st.eventsAfter, limit: 1000 })}`, { signal });
      for (const e of body.data) add(e);
      if (!body.has_more) break;
    }
  }

  return { el, add, load };
}

/** The job's checkpoints; `load(signal)` redraws them when they changed (`st.ckptKey`). */
export function checkpointsPart(id, st) {
  const rows = h("tbody");
  const el = h("section", { class: "card" }, h("h3", {}, "Checkpoints"),
    h("div", { class: "scroll" }, h("table", { id: "checkpoints" },
      h("thead", {}, h("tr", {}, ["Step", "Attempt", "Path", "Saved"].map((t) => h("th", {}, t)))),
      rows)));

  async function load(signal) {
    const body = await api(`/v1/jobs/${encodeURIComponent(id)}/checkpoints`, { signal });
    st.checkpoints = body.data;
    const key = body.data.map((c) => `${c.step}/${c.attempt}`).join();
    if (key === st.ckptKey && rows.childElementCount) return;
    st.ckptKey = key;
    rows.replaceChildren(...body.data.map((c) => h("tr", {},
      h("td", { class: "num" }, c.step), h("td", { class: "num" }, c.attempt),
      h("td", { class: "mono small path" }, c.path), h("td", { class: "small" }, fmtTime(c.created_at)))));
    if (!body.data.length) rows.append(h("tr", {}, h("td", { colSpan: 4, class: "muted" }, "None yet.")));
  }

  return { el, load };
}

/** The job's spec, every field with its default (spec.js). */
export function specPart() {
  const box = h("div", { id: "spec" });
  const el = h("section", { class: "card" }, h("h3", {}, "Spec", h("span", { class: "muted small" },
    "bold: set differently from the default · grey: default · hover a row for its meaning")), box);
  return { el, render: (spec) => renderSpec(box, spec) };
}
