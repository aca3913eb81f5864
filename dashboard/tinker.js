// The Tinker sessions page: the project's sessions of the Tinker API (docs/tinker.md), newest
// first, each with its training clients (base model, LoRA rank, status, the calls its worker
// applied, the last saved state), from GET /v1/tinker/sessions. Sessions have no change stream:
// the page polls every POLL_MS while it is open (api.js poller). Older sessions are a page
// further (#/tinker?after=<the last session id seen>). Below them, a chat panel asks the
// project's sampler weights saves (listed by GET /v1/models with their tinker:// path, served by
// the inference tier under their `ft:` names).

import { api, poller, qs } from "/dashboard/api.js";
import { chatPart } from "/dashboard/chat.js";
import { ageOf, badge, fmtDuration, fmtTime, h } from "/dashboard/dom.js";

const PAGE = 50;
const COLUMNS = ["Session", "Status", "Created", "Last heartbeat", "Training clients"];

/** The sampler saves of a /v1/models page, as the chat panel offers them (newest first). */
export function samplerModels(models) {
  return models.filter((m) => m.grpo_service?.tinker_path)
    .map((m) => ({ value: m.id, label: m.grpo_service.tinker_path }));
}

const ago = (iso) => h("span", { title: fmtTime(iso) }, `${fmtDuration(ageOf(iso))} ago`);

function callsText(m) {
  const parts = Object.entries(m.applied_by_kind).map(([kind, n]) => `${kind}: ${n}`);
  if (m.calls_failed) parts.push(`failed: ${m.calls_failed}`);
  if (m.calls_queued) parts.push(`waiting: ${m.calls_queued}`);
  return parts.join("\n") || "no calls yet";
}

function modelsTable(session) {
  if (!session.models.length) return h("span", { class: "muted small" }, "none");
  const more = session.model_count - session.models.length;
  return h("div", {},
    h("table", { class: "tinker-models" },
      h("thead", {}, h("tr", {}, ["Id", "Base model", "Rank", "Status", "Calls applied", "Last save"]
        .map((t) => h("th", { class: t === "Rank" || t === "Calls applied" ? "num" : "" }, t)))),
      h("tbody", {}, session.models.map((m) => h("tr", { dataset: { modelId: m.id, status: m.status } },
        h("td", { class: "mono small" }, m.id),
        h("td", { class: "mono small" }, m.base_model),
        h("td", { class: "num" }, m.lora_rank),
        h("td", { title: m.error_message || "" }, badge(m.status)),
        h("td", { class: "num calls", title: callsText(m) }, m.calls_applied,
          m.calls_failed ? h("span", { class: "error small" }, ` (${m.calls_failed} failed)`) : null),
        h("td", { class: "mono small path" }, m.last_saved_path || "–"))))),
    more > 0 ? h("div", { class: "muted small" }, `and ${more} older`) : null);
}

function row(s) {
  const name = s.display_name || s.id;
  const tags = s.tags.map((t) => h("span", { class: "tag" }, t));
  return h("tr", { dataset: { sessionId: s.id, status: s.status } },
    h("td", {}, h("div", { class: "strong" }, name, " ", tags),
      s.display_name ? h("div", { class: "muted small mono" }, s.id) : null,
      s.sdk_version ? h("div", { class: "muted small" }, `SDK ${s.sdk_version}`) : null),
    h("td", { title: s.finish_reason ? `closed: ${s.finish_reason}` : "" }, badge(s.status)),
    h("td", { class: "small nowrap" }, ago(s.created_at)),
    h("td", { class: "small nowrap" }, ago(s.heartbeat_at)),
    h("td", {}, modelsTable(s)));
}

export function tinkerView(root, params) {
  const after = params.get("after") || "";
  const summary = h("span", { class: "muted", id: "tinker-summary" });
  const pager = h("span", { class: "pager", id: "tinker-pager" });
  const tbody = h("tbody");
  let saves = [];
  const chat = chatPart(() => saves,
    "No sampler weights yet: save_weights_for_sampler in a training client makes one to ask here.");
  root.append(
    h("div", { class: "toolbar" }, h("h2", {}, "Tinker sessions"), summary, h("span", { class: "spacer" }), pager),
    h("section", { class: "card flush" },
      h("table", { class: "jobs tinker", id: "tinker-table" },
        h("thead", {}, h("tr", {}, COLUMNS.map((t) => h("th", {}, t)))), tbody)),
    chat.el);

  async function load(signal) {
    const [body, models] = await Promise.all([
      api(`/v1/tinker/sessions?${qs({ limit: PAGE, after })}`, { signal }),
      // The sampler saves come on the catalogue's first page whatever its job count: one job
      // (the least the API takes) keeps this poll from reading jobs' checkpoints it drops.
      api("/v1/models?limit=1", { signal }),
    ]);
    saves = samplerModels(models.data);
    chat.refresh();
    tbody.replaceChildren(...body.data.map(row));
    if (!body.data.length) {
      tbody.append(h("tr", {}, h("td", { colSpan: COLUMNS.length, class: "muted empty" },
        after ? "No older sessions." : "No Tinker sessions yet. Point the tinker SDK at this server (docs/tinker.md).")));
    }
    const live = body.data.filter((s) => s.live).length;
    const count = `${body.data.length}${body.has_more ? "+" : ""}`;
    summary.textContent = `${count} session${count === "1" ? "" : "s"}, ${live} live`;
    pager.replaceChildren(...[
      after ? h("a", { href: "#/tinker" }, "Newest") : null,
      body.next_after ? h("a", { href: `#/tinker?${qs({ after: body.next_after })}` }, "Older sessions") : null,
    ].filter(Boolean));
  }
  const polling = poller(load);
  return { now: polling.now, stop() { chat.stop(); polling.stop(); } };
}
