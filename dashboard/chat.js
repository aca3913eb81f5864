// The chat panel: ask a model a question and watch the answer stream in, through the API's
// OpenAI-compatible POST /v1/chat/completions (stream: true), as any client would. The job page
// offers the job's kept checkpoints (`<job id>@<step>`, the newest by default, usable while the
// job runs) and, once the job succeeded, its final weights (the job id); the Tinker page offers
// the project's sampler weights saves (their `ft:` names). The sampling settings sent are the
// ones shown. A model whose engine is still starting answers 503 with Retry-After: the panel
// says so and asks again after that wait. Stop (or leaving the page) aborts the request, and the
// API cancels the generation.

import { CSRF_HEADERS } from "/dashboard/api.js";
import { h } from "/dashboard/dom.js";

const MAX_RETRY_WAIT_S = 30; // a Retry-After longer than this is waited in 30 s slices
const GIVE_UP_AFTER_S = 300; // a cold engine of a fine-tuned model starts in tens of seconds
const MAX_OFFERED_CHECKPOINTS = 20; // the newest; older ones stay callable by name (grpo chat)

/** The model names the panel offers: the newest checkpoint first, then the final weights once
 * the job succeeded, then older checkpoints (the newest MAX_OFFERED_CHECKPOINTS). */
export function chatModels(id, job, checkpoints) {
  const steps = [...new Set((checkpoints || []).map((c) => c.step))].sort((a, b) => b - a)
    .slice(0, MAX_OFFERED_CHECKPOINTS);
  const names = steps.map((step) => ({ value: `${id}@${step}`, label: `checkpoint of step ${step}` }));
  if (job?.status === "succeeded") names.splice(Math.min(1, names.length), 0, { value: id, label: "final weights" });
  return names;
}

/** Server-sent event lines -> the text of each chunk (`data: {...}` until `data: [DONE]`). */
export async function* chunkTexts(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the generation failed");
      for (const choice of chunk.choices || []) {
        if (choice.delta?.content) yield choice.delta.content;
      }
    }
  }
}

/** The panel. `offered()` gives the models to offer now ({value, label}, the default first);
 * `emptyText` says why there is none yet. */
export function chatPart(offered, emptyText) {
  const model = h("select", { id: "chat-model", "aria-label": "Model" });
  const temperature = h("input", { id: "chat-temperature", type: "number", min: 0, max: 2, step: 0.1, value: 0.7 });
  const topP = h("input", { id: "chat-top-p", type: "number", min: 0.05, max: 1, step: 0.05, value: 1 });
  const maxTokens = h("input", { id: "chat-max-tokens", type: "number", min: 1, max: 4096, step: 1, value: 128 });
  const prompt = h("textarea", { id: "chat-prompt", rows: 2, placeholder: "Ask the model something" });
  const transcript = h("div", { id: "chat-transcript", class: "chat-log", "aria-live": "polite" });
  const status = h("div", { id: "chat-status", class: "muted small" });
  const send = h("button", { id: "chat-send", type: "submit" }, "Send");
  const stop = h("button", { id: "chat-stop", type: "button", disabled: true, onclick: () => ctrl?.abort() }, "Stop");
  const form = h("form", { class: "chat-form", onsubmit: (e) => { e.preventDefault(); ask(); } },
    prompt, send, stop);
  const settings = h("div", { class: "chat-settings small" },
    h("label", {}, "Model ", model), h("label", {}, "temperature ", temperature),
    h("label", {}, "top_p ", topP), h("label", {}, "max_tokens ", maxTokens));
  const el = h("section", { class: "card", id: "chat" }, h("h3", {}, "Try the model",
    h("span", { class: "muted small" }, "streamed from /v1/chat/completions")), settings, transcript, status, form);
  let ctrl = null;
  let shown = null; // the offered names last shown (none yet: the first refresh shows them)

  /** Offer the current models (called when what `offered` reads changes). */
  function refresh() {
    const names = offered();
    const key = names.map((n) => n.value).join();
    if (key === shown) return;
    shown = key;
    const chosen = model.value;
    model.replaceChildren(...names.map((n) => h("option", { value: n.value }, `${n.label} (${n.value})`)));
    if (names.some((n) => n.value === chosen)) model.value = chosen;
    send.disabled = !names.length || ctrl != null;
    if (!names.length) status.textContent = emptyText;
    else if (status.textContent === emptyText) status.textContent = "";
  }

  function settingsBody() {
    return {
      model: model.value,
      temperature: Number(temperature.value),
      top_p: Number(topP.value),
      max_tokens: Math.round(Number(maxTokens.value)),
    };
  }

  async function ask() {
    const text = prompt.value.trim();
    if (!text || ctrl || !model.value) return;
    const body = { ...settingsBody(), messages: [{ role: "user", content: text }], stream: true };
    const answer = h("div", { class: "chat-answer mono" });
    transcript.append(h("div", { class: "chat-question" }, text),
      h("div", { class: "chat-meta muted small", dataset: { model: body.model } }, `${body.model} · temperature ${body.temperature} · top_p ${body.top_p} · max_tokens ${body.max_tokens}`),
      answer);
    prompt.value = "";
    ctrl = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    try {
      await streamInto(answer, body, ctrl.signal);
      status.textContent = "";
    } catch (err) {
      status.textContent = err.name === "AbortError" ? "Stopped." : err.message;
    } finally {
      ctrl = null;
      send.disabled = !model.value;
      stop.disabled = true;
    }
  }

  async function streamInto(answer, body, signal) {
    const started = Date.now();
    for (;;) {
      const res = await fetch("/v1/chat/completions", {
        method: "POST", signal, cache: "no-store",
        headers: { ...CSRF_HEADERS, "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      if (res.status === 503 || res.status === 429) {
        const wait = Math.min(MAX_RETRY_WAIT_S, Number(res.headers.get("Retry-After")) || 2);
        const data = await res.json().catch(() => null);
        if ((Date.now() - started) / 1000 + wait > GIVE_UP_AFTER_S) throw new Error(data?.error?.message || "The model is not available.");
        status.textContent = `${data?.error?.message || "The model is starting."} Asking again in ${wait} s.`;
        await new Promise((resolve, reject) => {
          const timer = setTimeout(resolve, wait * 1000);
          signal.addEventListener("abort", () => { clearTimeout(timer); reject(new DOMException("stopped", "AbortError")); });
        });
        continue;
      }
      if (!res.ok) {
        const data = await res.json().catch(() => null);
        throw new Error(data?.error?.message || `${res.status} ${res.statusText}`);
      }
      status.textContent = "";
      for await (const piece of chunkTexts(res.body)) answer.append(piece);
      return;
    }
  }

  return { el, refresh, stop: () => ctrl?.abort() };
}
