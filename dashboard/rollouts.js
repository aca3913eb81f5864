// The job page's rollout viewer: one step's sampled groups, each a prompt and its completions
// with their rewards and advantages. A completion of an agent episode (it has a `transcript`)
// gets a row below it, opened by its "turns" button, with the episode's turns: the model's
// turns and their tool calls, the tools' results and the environment's messages, each kind
// drawn differently, and what ended the episode (with why, where the reason alone does not say:
// the environment's error). Groups without transcripts look as they always did.

import { api, qs } from "/dashboard/api.js";
import { fmtNum } from "/dashboard/charts.js";
import { h } from "/dashboard/dom.js";

/** The rollouts of one step, group by group: the latest step's while "follow latest" is on
 * (`st.follow`), else the step picked. `load(step, signal)` shows a step's. */
export function rolloutsPart(id, st) {
  const samples = h("div", { id: "samples" });
  const stepInput = h("input", { type: "number", id: "sample-step", min: 1, value: "", onchange: () => {
    st.follow = false; followBox.checked = false; load(Number(stepInput.value));
  } });
  const followBox = h("input", { type: "checkbox", id: "sample-follow", checked: true, onchange: () => {
    st.follow = followBox.checked;
    if (st.follow && st.job) load(st.job.progress.step);
  } });
  const stepBy = (d) => () => {
    st.follow = false; followBox.checked = false;
    load(Math.max(1, (st.sampleStep || 1) + d));
  };
  const el = h("section", { class: "card", id: "rollouts" },
    h("div", { class: "section-head" }, h("h3", {}, "Rollouts"),
      h("span", { class: "spacer" }),
      h("button", { type: "button", onclick: stepBy(-1), title: "Previous step" }, "◀"),
      h("label", {}, "Step ", stepInput),
      h("button", { type: "button", onclick: stepBy(1), title: "Next step" }, "▶"),
      h("label", {}, followBox, " follow latest")),
    samples);

  async function load(step, signal) {
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

  return { el, load };
}

function renderGroup(group, gi, found) {
  const graders = Object.keys(group.completions[0]?.rewards || {});
  const agent = group.completions.some((c) => c.transcript);
  const heads = ["#", "Reward", ...graders, "Advantage", "Tokens", "Finish", ...(agent ? ["Episode"] : []), "Completion"];
  return h("div", { class: "group" },
    h("div", { class: "group-head" }, h("span", { class: "tag" }, `group ${gi + 1}`),
      h("span", { class: "muted small" }, ` step ${found.step} · attempt ${found.attempt} · answer `),
      h("code", {}, group.answer ?? "–")),
    h("pre", { class: "prompt" }, group.prompt),
    h("table", { class: "completions" },
      h("thead", {}, h("tr", {}, heads.map((t) => h("th", {}, t)))),
      h("tbody", {}, group.completions.flatMap((c, i) => completionRows(c, i, graders, agent, heads.length)))));
}

/** A completion's row; with a transcript, also its turns' row (hidden until its button opens it). */
function completionRows(c, i, graders, agent, columns) {
  const cells = [
    h("td", { class: "num" }, i + 1),
    h("td", { class: "num strong" }, fmtNum(c.reward)),
    ...graders.map((g) => h("td", { class: "num" }, fmtNum(c.rewards[g]))),
    h("td", { class: `num ${c.advantage > 0 ? "pos" : c.advantage < 0 ? "neg" : ""}` }, fmtNum(c.advantage)),
    h("td", { class: "num" }, c.num_tokens),
    h("td", { class: "small" }, c.finish_reason),
  ];
  const t = c.transcript;
  if (!t) {
    return h("tr", {}, ...cells, agent ? h("td", {}) : null, h("td", {}, h("pre", { class: "completion" }, c.text)));
  }
  const detail = h("tr", { class: "transcript-row", hidden: true },
    h("td", { colSpan: columns }, renderTranscript(t)));
  const calls = t.turns.reduce((n, turn) => n + turn.tool_calls.length, 0);
  const toggle = h("button", { type: "button", class: "turns-toggle", "aria-expanded": "false", onclick: () => {
    detail.hidden = !detail.hidden;
    toggle.setAttribute("aria-expanded", String(!detail.hidden));
    toggle.firstChild.textContent = detail.hidden ? "▸" : "▾";
  } }, h("span", {}, "▸"), ` ${plural(t.turns.length + t.turns_left_out, "turn")}`);
  const summary = h("td", { class: "small nowrap" }, toggle,
    h("div", { class: "muted" }, `${plural(calls, "tool call")} · ${t.end_reason ?? "–"}`));
  return [h("tr", { class: "episode" }, ...cells, summary, h("td", {}, h("pre", { class: "completion" }, c.text))), detail];
}

const SOURCE_LABEL = { model: "model", tool: "tool result", environment: "environment" };

/** An episode's turns, in order, and why it ended. */
function renderTranscript(t) {
  const turns = t.turns.map((turn, k) => h("div", { class: `turn turn-${turn.source}${turn.error ? " turn-error" : ""}`, dataset: { source: turn.source } },
    h("div", { class: "turn-head small" },
      h("span", { class: "turn-kind" }, `${k + 1} · ${SOURCE_LABEL[turn.source] ?? turn.source}`),
      turn.name ? h("code", { class: "turn-name" }, turn.name) : null,
      h("span", { class: "muted" }, ` ${turn.role}`),
      turn.error ? h("span", { class: "error turn-err" }, ` failed: ${turn.error}`) : null),
    turn.content || turn.content_cut ? h("pre", { class: "turn-content" }, turn.content, cutNote(turn.content_cut)) : null,
    turn.tool_calls.map((call) => h("div", { class: "tool-call" },
      h("span", { class: "muted small" }, "calls "), h("code", { class: "call-name" }, call.name),
      h("pre", { class: "call-args" }, call.arguments, cutNote(call.arguments_cut)))),
    turn.malformed.map((why) => h("div", { class: "error small malformed" }, `unreadable call: ${why}`))));
  return h("div", { class: "transcript" }, turns,
    t.turns_left_out ? h("p", { class: "muted small left-out" }, `${plural(t.turns_left_out, "more turn")} not shown`) : null,
    h("p", { class: "small end-reason" }, "Episode ended: ", h("code", {}, t.end_reason ?? "–"),
      t.end_detail ? h("span", { class: "end-detail" }, ` (${t.end_detail})`) : null));
}

function cutNote(n) {
  return n ? h("span", { class: "muted cut" }, ` … ${n.toLocaleString()} more characters`) : null;
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}
