// grpo-service dashboard: routing, sign-in, jobs list and compare page; the job page is job.js,
// the Tinker sessions page tinker.js.
// Plain DOM, no framework. Sign-in and every data call go through api.js (a session cookie;
// the page keeps no key). The jobs list follows the project's change stream (/v1/stream) and
// reads the list again when it says a job changed; the compare page polls every 2 s; the job
// page follows the job's event stream. Text from the API only ever enters the DOM as text nodes
// (dom.js h()), and the page's Content-Security-Policy allows no inline script or style.

import { api, followProject, loadSession, onSessionEnd, qs, session, signIn, signOut } from "/dashboard/api.js";
import { StepChart, alignSeries, fmtNum } from "/dashboard/charts.js";
import { STATUSES, TERMINAL, ageOf, badge, fmtDuration, fmtTime, h, klText, progressBar } from "/dashboard/dom.js";
import { jobView } from "/dashboard/job.js";
import { tinkerView } from "/dashboard/tinker.js";

const compareSelection = new Set();

// ------------------------------------------------------------------ routing

let current = null;

function route(message) {
  current?.stop();
  current = null;
  const root = document.getElementById("view");
  root.replaceChildren();
  document.getElementById("sign-out").hidden = !session;
  document.getElementById("project").textContent = session ? session.project_name : "";
  if (!session) { current = keyView(root, typeof message === "string" ? message : ""); return; }
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const params = new URLSearchParams(query || "");
  const job = path.match(/^\/jobs\/([^/]+)$/);
  let nav = "jobs";
  if (job) current = jobView(root, decodeURIComponent(job[1]));
  else if (path === "/compare") { nav = "compare"; current = compareView(root, params); }
  else if (path === "/tinker") { nav = "tinker"; current = tinkerView(root, params); }
  else current = listView(root, params);
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.classList.toggle("active", a.dataset.nav === nav);
  }
}

function keyView(root, message) {
  const input = h("input", { id: "api-key", type: "password", placeholder: "API key", autocomplete: "off", required: true });
  const error = h("p", { class: "error", hidden: !message }, message);
  const button = h("button", { class: "primary", type: "submit" }, "Open dashboard");
  const form = h("form", { class: "card key-form", onsubmit: async (e) => {
    e.preventDefault();
    button.disabled = true;
    try {
      await signIn(input.value.trim());
      input.value = "";
      route();
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
      button.disabled = false;
    }
  } },
  h("h2", {}, "Sign in with an API key"),
  h("p", { class: "muted" }, "The key is sent once and exchanged for a session cookie that ",
    "scripts cannot read and that expires; this page does not keep the key. ",
    "Create one with ", h("code", {}, "grpo keys create"), "."),
  error,
  h("div", { class: "row" }, input, button));
  root.append(form);
  input.focus();
  return { stop() {} };
}

// ------------------------------------------------------------------ jobs list

function listView(root, params) {
  const status = STATUSES.includes(params.get("status")) ? params.get("status") : "";
  const filter = h("select", { id: "status-filter", onchange: () => {
    location.hash = filter.value ? `#/?status=${filter.value}` : "#/";
  } }, h("option", { value: "" }, "All statuses"), STATUSES.map((s) => h("option", { value: s }, s)));
  filter.value = status;
  const compare = h("button", { class: "primary", id: "compare-selected", onclick: () => {
    location.hash = `#/compare?${qs({ jobs: [...compareSelection].join(",") })}`;
  } });
  const summary = h("span", { class: "muted" });
  const tbody = h("tbody");
  const table = h("table", { class: "jobs", id: "jobs-table" },
    h("thead", {}, h("tr", {}, ["", "Job", "Status", "Model", "KL", "Progress", "Reward", "Age"]
      .map((t) => h("th", { class: t === "Reward" ? "num" : "" }, t)))),
    tbody);
  root.append(
    h("div", { class: "toolbar" }, h("h2", {}, "Jobs"), h("label", {}, "Status ", filter), summary,
      h("span", { class: "spacer" }), compare),
    h("section", { class: "card flush" }, table));

  const updateCompare = () => {
    compare.textContent = `Compare selected (${compareSelection.size})`;
    compare.disabled = compareSelection.size === 0;
  };
  updateCompare();

  function row(job) {
    const p = job.progress;
    const reward = p.last_metrics?.["reward/mean"];
    const box = h("input", { type: "checkbox", checked: compareSelection.has(job.id),
      title: "Select for the compare page", onchange: () => {
        if (box.checked) compareSelection.add(job.id); else compareSelection.delete(job.id);
        updateCompare();
      } });
    const link = h("a", { href: `#/jobs/${encodeURIComponent(job.id)}` }, job.name || job.id);
    return h("tr", { dataset: { jobId: job.id, status: job.status } },
      h("td", { class: "narrow" }, box),
      h("td", {}, link, job.name ? h("div", { class: "muted small mono" }, job.id) : null),
      h("td", {}, badge(job.status)),
      h("td", { class: "mono small" }, job.model),
      h("td", { class: "small" }, klText(job.spec)),
      h("td", { class: "progress-cell" }, progressBar(p.step, p.total_steps),
        h("span", { class: "small step" }, `${p.step} / ${p.total_steps}`)),
      h("td", { class: "num", title: "reward/mean of the last step" }, fmtNum(reward)),
      h("td", { class: "small", title: fmtTime(job.created_at) }, fmtDuration(ageOf(job.created_at))));
  }

  async function load(signal) {
    const body = await api(`/v1/jobs?${qs({ limit: 100, status })}`, { signal });
    tbody.replaceChildren(...body.data.map(row));
    if (!body.data.length) {
      tbody.append(h("tr", {}, h("td", { colSpan: 8, class: "muted empty" },
        status ? `No ${status} jobs.` : "No jobs yet. Submit one with POST /v1/jobs.")));
    }
    const running = body.data.filter((j) => !TERMINAL.has(j.status)).length;
    summary.textContent = `${body.data.length}${body.has_more ? "+" : ""} jobs, ${running} active`;
  }
  // Read again only when the project's stream says a job changed.
  return followProject(load);
}

// ------------------------------------------------------------------ compare page

function compareView(root, params) {
  const chosen = new Set((params.get("jobs") || "").split(",").filter(Boolean));
  let metric = params.get("metric") || "reward/mean";
  const metricSelect = h("select", { id: "compare-metric", onchange: () => { metric = metricSelect.value; sync(); } });
  const picker = h("div", { class: "picker", id: "compare-jobs" });
  const host = h("div", {});
  const chart = new StepChart(host, { key: "compare", title: "", height: 380 });
  root.append(
    h("div", { class: "toolbar" }, h("h2", {}, "Compare jobs"), h("label", {}, "Metric ", metricSelect)),
    h("div", { class: "compare" }, h("section", { class: "card" }, h("h3", {}, "Jobs"), picker), host));
  const resize = new ResizeObserver(() => chart.resize());
  resize.observe(host);

  function sync() {
    const hash = `#/compare?${qs({ jobs: [...chosen].join(","), metric })}`;
    history.replaceState(null, "", hash);
    compareSelection.clear();
    for (const j of chosen) compareSelection.add(j);
    live.now();
  }

  let jobs = [];
  async function load(signal) {
    jobs = (await api(`/v1/jobs?${qs({ limit: 100 })}`, { signal })).data;
    const known = new Set(jobs.map((j) => j.id));
    for (const j of chosen) {
      if (!known.has(j)) {
        try { jobs.push(await api(`/v1/jobs/${encodeURIComponent(j)}`, { signal })); } catch { chosen.delete(j); }
      }
    }
    picker.replaceChildren(...jobs.map((j) => h("label", { class: "pick" },
      h("input", { type: "checkbox", checked: chosen.has(j.id), value: j.id, onchange: (e) => {
        if (e.target.checked) chosen.add(j.id); else chosen.delete(j.id);
        sync();
      } }),
      " ", h("span", {}, j.name || j.id), " ", badge(j.status))));
    const picked = jobs.filter((j) => chosen.has(j.id));
    const results = await Promise.all(picked.map((j) =>
      api(`/v1/jobs/${encodeURIComponent(j.id)}/metrics?${qs({ names: metric, max_points: 1000 })}`, { signal })));
    const available = new Set(["reward/mean"]);
    for (const r of results) for (const n of r.available) available.add(n);
    const names = [...available].sort();
    if (names.join() !== [...metricSelect.options].map((o) => o.value).join()) {
      metricSelect.replaceChildren(...names.map((n) => h("option", { value: n }, n)));
    }
    metricSelect.value = metric;
    const byJob = {};
    const labels = picked.map((j) => `${j.name || j.id} (${klText(j.spec)})`);
    results.forEach((r, i) => { byJob[labels[i]] = r.series[metric] || []; });
    const { steps, columns } = alignSeries(byJob, labels);
    chart.title.textContent = picked.length ? metric : "Pick jobs on the left";
    chart.update(steps, labels.map((l, i) => ({ label: l, values: columns[i] })));
  }
  // Read again only when the project's stream reports a change (a compared job's step too).
  const live = followProject(load);

  return { stop() { live.stop(); resize.disconnect(); } };
}

// ------------------------------------------------------------------ start

onSessionEnd((message) => route(message));
document.getElementById("sign-out").addEventListener("click", async () => { await signOut(); route(""); });
window.addEventListener("hashchange", () => route());
loadSession().then(route, (err) => route(`The API did not answer: ${err.message}`));
