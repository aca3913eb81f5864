// The job page: progress, charts, events, checkpoints, rollouts and the spec. It loads once over
// plain requests, then follows the job's server-sent event stream (GET /v1/jobs/{id}/stream):
// `metrics` messages add chart points, `status` and `event` messages update the status and the
// log, and what the stream does not carry (ETA, checkpoints, rollouts) is fetched when it says
// something happened. Only while the stream is down does the page poll (api.js follow()).

import { AuthError, POLL_MS, api, follow, qs, setConn } from "/dashboard/api.js";
import { StepChart, alignSeries, fmtNum } from "/dashboard/charts.js";
import { TERMINAL, badge, fmtDuration, fmtTime, graderNames, h, klText, progressBar } from "/dashboard/dom.js";
import { renderSpec } from "/dashboard/spec.js";

const MAX_CACHED_POINTS = 6000; // per series; past this the job page keeps every other point

const CHARTS = [
  { key: "reward", title: "Reward", names: (spec) => ["reward/mean", ...graderNames(spec).map((g) => `reward/${g}/mean`)],
    label: (n) => (n === "reward/mean" ? "total" : n.split("/")[1]) },
  { key: "grader_errors", title: "Grader errors (samples scored 0)",
    names: (spec) => graderNames(spec).map((g) => `reward/${g}/errors`),
    label: (n) => n.split("/")[1] },
  { key: "kl", title: "KL to the reference", names: () => ["kl", "kl_k3"] },
  { key: "entropy", title: "Entropy", names: () => ["entropy"] },
  { key: "mismatch", title: "Sampler vs trainer", names: () => ["mismatch/kl", "mismatch/capped_frac"],
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

export function jobView(root, id) {
  const st = {
    job: null, series: {}, available: [], metricStep: null, eventsAfter: null,
    eventCount: 0, ckptKey: "", sampleStep: null, follow: true, final: false,
    partsStep: null, // the job step checkpoints and rollouts were last loaded at
  };
  const title = h("h2", { id: "job-title" }, id);
  const status = h("span", { id: "job-status" });
  const cancel = h("button", { id: "cancel-job", class: "danger", onclick: onCancel }, "Cancel job");
  const pauseBtn = h("button", { id: "pause-job", onclick: () => onControl("pause") }, "Pause");
  const resumeBtn = h("button", { id: "resume-job", onclick: () => onControl("resume") }, "Resume");
  const meta = h("div", { class: "meta muted small" });
  const prog = h("div", { class: "card progress", id: "job-progress" });
  const grid = h("div", { class: "charts", id: "charts" });
  const charts = CHARTS.map((c) => ({ def: c, chart: new StepChart(grid, { key: c.key, title: c.title, stacked: c.stacked }) }));
  const extraSelect = h("select", { id: "extra-metric", onchange: drawCharts });
  const extra = new StepChart(grid, { key: "extra", title: "Any metric" });
  extra.title.after(" ", extraSelect);
  const events = h("tbody");
  const ckpts = h("tbody");
  const samples = h("div", { id: "samples" });
  const stepInput = h("input", { type: "number", id: "sample-step", min: 1, value: "", onchange: () => {
    st.follow = false; followBox.checked = false; loadSamples(Number(stepInput.value));
  } });
  const followBox = h("input", { type: "checkbox", id: "sample-follow", checked: true, onchange: () => {
    st.follow = followBox.checked;
    if (st.follow && st.job) loadSamples(st.job.progress.step);
  } });
  const stepBy = (d) => () => {
    st.follow = false; followBox.checked = false;
    loadSamples(Math.max(1, (st.sampleStep || 1) + d));
  };
  const specBox = h("div", { id: "spec" });

  root.append(
    h("div", { class: "job-head" }, h("div", {}, h("a", { href: "#/", class: "small" }, "← Jobs"), title, meta),
      h("span", { class: "spacer" }), status, pauseBtn, resumeBtn, cancel),
    prog, grid,
    h("section", { class: "card", id: "rollouts" },
      h("div", { class: "section-head" }, h("h3", {}, "Rollouts"),
        h("span", { class: "spacer" }),
        h("button", { type: "button", onclick: stepBy(-1), title: "Previous step" }, "◀"),
        h("label", {}, "Step ", stepInput),
        h("button", { type: "button", onclick: stepBy(1), title: "Next step" }, "▶"),
        h("label", {}, followBox, " follow latest")),
      samples),
    h("div", { class: "two-col" },
      h("section", { class: "card" }, h("h3", {}, "Events"),
        h("div", { class: "scroll" }, h("table", { class: "events", id: "events" },
          h("thead", {}, h("tr", {}, ["Time", "Type", "Message"].map((t) => h("th", {}, t)))), events))),
      h("section", { class: "card" }, h("h3", {}, "Checkpoints"),
        h("div", { class: "scroll" }, h("table", { id: "checkpoints" },
          h("thead", {}, h("tr", {}, ["Step", "Attempt", "Path", "Saved"].map((t) => h("th", {}, t)))),
          ckpts)))),
    h("section", { class: "card" }, h("h3", {}, "Spec", h("span", { class: "muted small" },
      "bold: set differently from the default · grey: default · hover a row for its meaning")), specBox));

  const resize = new ResizeObserver(() => { for (const c of charts) c.chart.resize(); extra.resize(); });
  resize.observe(grid);

  async function onCancel() {
    if (!confirm(`Cancel job ${id}? A running job stops within one step and keeps its last checkpoint.`)) return;
    cancel.disabled = true;
    try {
      renderJob(await api(`/v1/jobs/${encodeURIComponent(id)}/cancel`, { method: "POST" }));
      refreshSoon();
    } catch (err) {
      if (!(err instanceof AuthError)) alert(`Cancel failed: ${err.message}`);
      cancel.disabled = false;
    }
  }

  async function onControl(action) {
    pauseBtn.disabled = resumeBtn.disabled = true;
    try {
      renderJob(await api(`/v1/jobs/${encodeURIComponent(id)}/${action}`, { method: "POST" }));
      refreshSoon();
    } catch (err) {
      if (!(err instanceof AuthError)) alert(`${action} failed: ${err.message}`);
      if (st.job) renderJob(st.job);
    }
  }

  function renderJob(job) {
    st.job = job;
    const p = job.progress;
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
    const elapsed = job.started_at ? ((job.finished_at ? Date.parse(job.finished_at) : Date.now()) - Date.parse(job.started_at)) / 1000 : null;
    const stat = (label, value, idAttr) => h("div", { class: "stat" }, h("div", { class: "muted small" }, label), h("div", { class: "value", id: idAttr }, value));
    prog.replaceChildren(
      h("div", { class: "progress-line" }, progressBar(p.step, p.total_steps),
        h("span", { id: "job-step" }, `step ${p.step} of ${p.total_steps}`)),
      h("div", { class: "stats" },
        stat("ETA", TERMINAL.has(job.status) ? "done" : fmtDuration(p.eta_s), "job-eta"),
        stat("Elapsed", fmtDuration(elapsed)),
        stat("Reward (last step)", fmtNum(p.last_metrics?.["reward/mean"])),
        stat("Heartbeat", p.heartbeat_age_s == null ? "–" : `${fmtDuration(p.heartbeat_age_s)} ago`),
        stat("Attempt", `${job.attempt} of ${job.max_attempts}`),
        stat("Finished", fmtTime(job.finished_at))),
      job.error ? h("p", { class: "error" }, `${job.error.code}: ${job.error.message || ""}`) : "");
  }

  async function loadMetrics(signal) {
    const enc = encodeURIComponent(id);
    const first = st.metricStep == null;
    const url = first
      ? `/v1/jobs/${enc}/metrics?max_points=2000`
      : `/v1/jobs/${enc}/metrics?step_from=${st.metricStep + 1}`;
    const body = await api(url, { signal });
    if (first) st.series = {};
    for (const [name, points] of Object.entries(body.series)) {
      (st.series[name] ||= []).push(...points.map((pt) => ({ step: pt.step, value: pt.value })));
      for (const pt of points) st.metricStep = Math.max(st.metricStep ?? 0, pt.step);
    }
    if (first && st.metricStep == null) st.metricStep = 0;
    st.available = [...new Set([...st.available, ...body.available])].sort();
    thinSeries();
    drawCharts();
  }

  /** One step's metrics from the stream (`values` may hold null for a non-finite value). */
  function addStepMetrics({ step, values }) {
    if (st.metricStep != null && step <= st.metricStep) return; // already have it
    for (const [name, value] of Object.entries(values)) {
      if (value != null) (st.series[name] ||= []).push({ step, value });
    }
    st.metricStep = step;
    const names = Object.keys(values).filter((n) => !st.available.includes(n));
    if (names.length) st.available = [...st.available, ...names].sort();
    thinSeries();
    drawCharts();
    if (st.job && step > st.job.progress.step) {
      st.job.progress.step = step;
      st.job.progress.last_metrics = values;
      renderJob(st.job);
    }
  }

  /** A long job's series stay bounded in the page: past MAX_CACHED_POINTS, every other point
   * goes (the latest stays). */
  function thinSeries() {
    for (const [name, points] of Object.entries(st.series)) {
      if (points.length > MAX_CACHED_POINTS) {
        st.series[name] = points.filter((_, i) => i % 2 === 1 || i === points.length - 1);
      }
    }
  }

  function drawCharts() {
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

  /** One job event as a row at the top of the table; an event already shown is skipped. */
  function addEvent(e) {
    if (st.eventsAfter != null && e.id <= st.eventsAfter) return;
    events.prepend(h("tr", { class: `lvl-${e.level}` },
      h("td", { class: "small nowrap", title: fmtTime(e.created_at) }, new Date(e.created_at).toLocaleTimeString()),
      h("td", {}, h("span", { class: "tag" }, e.type)),
      h("td", {}, e.message)));
    st.eventCount += 1;
    st.eventsAfter = e.id;
  }

  async function loadEvents(signal) {
    for (;;) {
      const body = await api(`/v1/jobs/${encodeURIComponent(id)}/events?${qs({ after: st.eventsAfter, limit: 1000 })}`, { signal });
      for (const e of body.data) addEvent(e);
      if (!body.has_more) break;
    }
  }

  async function loadCheckpoints(signal) {
    const body = await api(`/v1/jobs/${encodeURIComponent(id)}/checkpoints`, { signal });
    const key = body.data.map((c) => `${c.step}/${c.attempt}`).join();
    if (key === st.ckptKey && ckpts.childElementCount) return;
    st.ckptKey = key;
    ckpts.replaceChildren(...body.data.map((c) => h("tr", {},
      h("td", { class: "num" }, c.step), h("td", { class: "num" }, c.attempt),
      h("td", { class: "mono small path" }, c.path), h("td", { class: "small" }, fmtTime(c.created_at)))));
    if (!body.data.length) ckpts.append(h("tr", {}, h("td", { colSpan: 4, class: "muted" }, "None yet.")));
  }

  async function loadSamples(step, signal) {
    if (!step) {
      samples.replaceChildren(h("p", { class: "muted" }, "No steps finished yet."));
      return;
    }
    st.sampleStep = step;
    stepInput.value = String(step);
    stepInput.max = String(st.job?.progress.step || step);
    const body = await api(`/v1/jobs/${encodeURIComponent(id)}/samples?${qs({ step, limit: 1 })}`, { signal });
    if (st.sampleStep !== step) return; // a newer selection won the race
    const found = body.data[0];
    if (!found) {
      samples.replaceChildren(h("p", { class: "muted" }, `No samples recorded for step ${step}.`));
      return;
    }
    samples.replaceChildren(...found.groups.map((g, gi) => renderGroup(g, gi, found)));
  }

  function renderGroup(group, gi, found) {
    const graders = Object.keys(group.completions[0]?.rewards || {});
    return h("div", { class: "group" },
      h("div", { class: "group-head" }, h("span", { class: "tag" }, `group ${gi + 1}`),
        h("span", { class: "muted small" }, ` step ${found.step} · attempt ${found.attempt} · answer `),
        h("code", {}, group.answer ?? "–")),
      h("pre", { class: "prompt" }, group.prompt),
      h("table", { class: "completions" },
        h("thead", {}, h("tr", {}, ["#", "Reward", ...graders, "Advantage", "Tokens", "Finish", "Completion"]
          .map((t) => h("th", {}, t)))),
        h("tbody", {}, group.completions.map((c, i) => h("tr", {},
          h("td", { class: "num" }, i + 1),
          h("td", { class: "num strong" }, fmtNum(c.reward)),
          graders.map((g) => h("td", { class: "num" }, fmtNum(c.rewards[g]))),
          h("td", { class: `num ${c.advantage > 0 ? "pos" : c.advantage < 0 ? "neg" : ""}` }, fmtNum(c.advantage)),
          h("td", { class: "num" }, c.num_tokens),
          h("td", { class: "small" }, c.finish_reason),
          h("td", {}, h("pre", { class: "completion" }, c.text)))))));
  }

  /** Everything over plain requests: the first load, and each poll while the stream is down.
   * Returns false once a pass after the job ended has picked up its final rows. */
  async function loadAll(signal) {
    const before = st.job?.progress.step;
    const job = await api(`/v1/jobs/${encodeURIComponent(id)}`, { signal });
    const firstLoad = !st.job;
    renderJob(job);
    if (firstLoad) renderSpec(specBox, job.spec);
    await loadEvents(signal);
    if (firstLoad || job.progress.step !== before || TERMINAL.has(job.status)) await loadMetrics(signal);
    await loadParts(job, signal);
    if (TERMINAL.has(job.status)) {
      if (st.final) return false;
      st.final = true;
    }
    return true;
  }

  /** What the stream does not carry (progress, ETA, checkpoints, rollouts): fetched when the
   * stream says something happened, at most once per POLL_MS. */
  let refreshing = null, refreshTimer = null, lastRefresh = 0;
  function refreshSoon() {
    if (refreshTimer || stopped) return;
    refreshTimer = setTimeout(async () => {
      await refreshing;
      refreshTimer = null;
      lastRefresh = Date.now();
      refreshing = refreshParts().catch((err) => {
        if (err.name !== "AbortError" && !(err instanceof AuthError)) setConn(false, err.message);
      });
    }, Math.max(0, lastRefresh + POLL_MS - Date.now()));
  }

  async function refreshParts() {
    const job = await api(`/v1/jobs/${encodeURIComponent(id)}`, { signal: ctrl.signal });
    renderJob(job);
    await loadParts(job, ctrl.signal);
  }

  /** Checkpoints and the latest rollouts, when the job moved since they were last loaded (the
   * stream moves st.job's step ahead of them, so they keep a step of their own). */
  async function loadParts(job, signal) {
    if (job.progress.step === st.partsStep && !TERMINAL.has(job.status)) return;
    await loadCheckpoints(signal);
    if (st.follow) await loadSamples(job.progress.step, signal);
    st.partsStep = job.progress.step;
  }

  // Load once, then follow the stream from where that load ended (`<event id>.<step>`).
  const ctrl = new AbortController();
  let stopped = false, live = null;
  (async () => {
    try {
      await loadAll(ctrl.signal);
      setConn(true);
    } catch (err) {
      if (err.name === "AbortError" || err instanceof AuthError) return;
      setConn(false, err.message);
    }
    if (stopped || (st.job && TERMINAL.has(st.job.status))) return;
    live = follow({
      url: () => `/v1/jobs/${encodeURIComponent(id)}/stream?${qs({ after: `${st.eventsAfter ?? 0}.${st.metricStep ?? 0}` })}`,
      on: {
        metrics: (m) => { addStepMetrics(m); refreshSoon(); },
        // A job event (a checkpoint saved, say) can change the checkpoints at the same step.
        event: (e) => { addEvent(e); st.partsStep = null; refreshSoon(); },
        status: (e) => { addEvent(e); refreshSoon(); },
        end: () => { refreshSoon(); },
      },
      poll: loadAll,
    });
  })();
  return {
    stop() {
      stopped = true;
      ctrl.abort();
      clearTimeout(refreshTimer);
      live?.stop();
      resize.disconnect();
    },
  };
}
