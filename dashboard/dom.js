// DOM building and formatting shared by the dashboard's pages. h() is the only way the pages
// build elements: text from the API (job names, prompts, completions) enters the DOM as text
// nodes, never parsed as HTML.

import { fmtNum } from "/dashboard/charts.js";

export const STATUSES = ["queued", "running", "pausing", "paused", "cancelling", "succeeded", "failed", "cancelled"];
export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);


/** h("div", {class: "x", onclick: f}, child, "text") -> element; text is never parsed as HTML. */
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v == null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k in el) el[k] = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c != null && c !== false) el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

export function fmtDuration(seconds) {
  if (seconds == null || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export const ageOf = (iso) => (Date.now() - Date.parse(iso)) / 1000;
export const fmtTime = (iso) => (iso ? new Date(iso).toLocaleString() : "–");
export const badge = (status) => h("span", { class: `badge s-${status}`, dataset: { status } }, status);

export function progressBar(step, total) {
  const pct = total ? Math.min(100, (100 * step) / total) : 0;
  return h("div", { class: "bar", title: `${pct.toFixed(0)}%` },
    h("div", { class: "fill", style: `width:${pct}%` }));
}

export function klText(spec) {
  const kl = spec?.grpo?.kl;
  if (!kl) return "–";
  const off = kl.estimator === "none" || !(kl.beta > 0);
  return off ? `off (${kl.estimator})` : `${kl.estimator} · β ${fmtNum(kl.beta)}`;
}

export function graderNames(spec) {
  return (spec?.graders || []).map((g) => g.name || g.type);
}
