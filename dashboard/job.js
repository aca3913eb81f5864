// The job page: progress, charts, events, checkpoints, rollouts, a chat with the job's model
// (chat.js) and the spec. It loads once over plain requests, then follows the job's server-sent
// event stream (GET /v1/jobs/{id}/stream): `metrics` messages add chart points, `status` and
// `event` messages update the status and the log, and what the stream does not carry (ETA,
// checkpoints, rollouts) is fetched when it says something happened. Only while the stream is
// down does the page poll (api.js follow()). The page's parts, and how each is drawn, are in
// job_parts.js and rollouts.js; this module loads their data.

import { AuthError, POLL_MS, api, follow, qs, setConn } from "/dashboard/api.js";
import { chatModels, chatPart } from "/dashboard/chat.js";
import { TERMINAL, h } from "/dashboard/dom.js";
import {
  chartsPart, checkpointsPart, eventsPart, headerPart, progressPart, specPart,
} from "/dashboard/job_parts.js";
import { rolloutsPart } from "/dashboard/rollouts.js";

const MAX_CACHED_POINTS = 6000; // per series; past this the job page keeps every other point

export function jobView(root, id) {
  const page = new JobPage(root, id);
  page.start();
  return { stop: () => page.stop() };
}

class JobPage {
  constructor(root, id) {
    this.id = id;
    const st = this.st = {
      job: null, series: {}, available: [], metricStep: null, eventsAfter: null,
      eventCount: 0, ckptKey: "", sampleStep: null, follow: true, final: false,
      partsStep: null, // the job step checkpoints and rollouts were last loaded at
    };
    this.header = headerPart(id, {
      act: (action) => this.act(action),
      restore: () => { if (st.job) this.renderJob(st.job); },
    });
    this.progress = progressPart();
    this.charts = chartsPart(st);
    this.rollouts = rolloutsPart(id, st);
    this.events = eventsPart(id, st);
    this.checkpoints = checkpointsPart(id, st);
    this.chat = chatPart(() => chatModels(id, st.job, st.checkpoints),
      "No checkpoint yet: the panel can ask the model once the job saves one.");
    this.spec = specPart();
    root.append(this.header.el, this.progress.el, this.charts.el, this.rollouts.el,
      h("div", { class: "two-col" }, this.events.el, this.checkpoints.el), this.chat.el, this.spec.el);
    this.ctrl = new AbortController();
    this.stopped = false;
    this.live = null;
    // What the stream does not carry, fetched at most once per POLL_MS (refreshSoon).
    this.refreshing = null;
    this.refreshTimer = null;
    this.lastRefresh = 0;
  }

  /** Post "cancel", "pause" or "resume", and show the job it answers. */
  async act(action) {
    this.renderJob(await api(`/v1/jobs/${encodeURIComponent(this.id)}/${action}`, { method: "POST" }));
    this.refreshSoon();
  }

  renderJob(job) {
    this.st.job = job;
    this.header.render(job);
    this.progress.render(job);
    this.chat.refresh();
  }

  async loadMetrics(signal) {
    const st = this.st;
    const enc = encodeURIComponent(this.id);
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
    this.thinSeries();
    this.charts.draw();
  }

  /** One step's metrics from the stream (`values` may hold null for a non-finite value). */
  addStepMetrics({ step, values }) {
    const st = this.st;
    if (st.metricStep != null && step <= st.metricStep) return; // already have it
    for (const [name, value] of Object.entries(values)) {
      if (value != null) (st.series[name] ||= []).push({ step, value });
    }
    st.metricStep = step;
    const names = Object.keys(values).filter((n) => !st.available.includes(n));
    if (names.length) st.available = [...st.available, ...names].sort();
    this.thinSeries();
    this.charts.draw();
    if (st.job && step > st.job.progress.step) {
      st.job.progress.step = step;
      st.job.progress.last_metrics = values;
      this.renderJob(st.job);
    }
  }

  /** A long job's series stay bounded in the page: past MAX_CACHED_POINTS, every other point
   * goes (the latest stays). */
  thinSeries() {
    const st = this.st;
    for (const [name, points] of Object.entries(st.series)) {
      if (points.length > MAX_CACHED_POINTS) {
        st.series[name] = points.filter((_, i) => i % 2 === 1 || i === points.length - 1);
      }
    }
  }

  /** Everything over plain requests: the first load, and each poll while the stream is down.
   * Returns false once a pass after the job ended has picked up its final rows. */
  async loadAll(signal) {
    const st = this.st;
    const before = st.job?.progress.step;
    const job = await api(`/v1/jobs/${encodeURIComponent(this.id)}`, { signal });
    const firstLoad = !st.job;
    this.renderJob(job);
    if (firstLoad) this.spec.render(job.spec);
    await this.events.load(signal);
    if (firstLoad || job.progress.step !== before || TERMINAL.has(job.status)) await this.loadMetrics(signal);
    await this.loadParts(job, signal);
    if (TERMINAL.has(job.status)) {
      if (st.final) return false;
      st.final = true;
    }
    return true;
  }

  /** What the stream does not carry (progress, ETA, checkpoints, rollouts): fetched when the
   * stream says something happened, at most once per POLL_MS. */
  refreshSoon() {
    if (this.refreshTimer || this.stopped) return;
    this.refreshTimer = setTimeout(async () => {
      await this.refreshing;
      this.refreshTimer = null;
      this.lastRefresh = Date.now();
      this.refreshing = this.refreshParts().catch((err) => {
        if (err.name !== "AbortError" && !(err instanceof AuthError)) setConn(false, err.message);
      });
    }, Math.max(0, this.lastRefresh + POLL_MS - Date.now()));
  }

  async refreshParts() {
    const job = await api(`/v1/jobs/${encodeURIComponent(this.id)}`, { signal: this.ctrl.signal });
    this.renderJob(job);
    await this.loadParts(job, this.ctrl.signal);
  }

  /** Checkpoints and the latest rollouts, when the job moved since they were last loaded (the
   * stream moves st.job's step ahead of them, so they keep a step of their own). */
  async loadParts(job, signal) {
    const st = this.st;
    if (job.progress.step === st.partsStep && !TERMINAL.has(job.status)) return;
    await this.checkpoints.load(signal);
    this.chat.refresh();
    if (st.follow) await this.rollouts.load(job.progress.step, signal);
    st.partsStep = job.progress.step;
  }

  /** Load once, then follow the stream from where that load ended (`<event id>.<step>`). */
  async start() {
    const st = this.st;
    try {
      await this.loadAll(this.ctrl.signal);
      setConn(true);
    } catch (err) {
      if (err.name === "AbortError" || err instanceof AuthError) return;
      setConn(false, err.message);
    }
    if (this.stopped || (st.job && TERMINAL.has(st.job.status))) return;
    this.live = follow({
      url: () => `/v1/jobs/${encodeURIComponent(this.id)}/stream?${qs({ after: `${st.eventsAfter ?? 0}.${st.metricStep ?? 0}` })}`,
      on: {
        metrics: (m) => { this.addStepMetrics(m); this.refreshSoon(); },
        // A job event (a checkpoint saved, say) can change the checkpoints at the same step.
        event: (e) => { this.events.add(e); st.partsStep = null; this.refreshSoon(); },
        status: (e) => { this.events.add(e); this.refreshSoon(); },
        end: () => { this.refreshSoon(); },
      },
      poll: (signal) => this.loadAll(signal),
    });
  }

  stop() {
    this.stopped = true;
    this.ctrl.abort();
    clearTimeout(this.refreshTimer);
    this.live?.stop();
    this.charts.stop();
    this.chat.stop();
  }
}
