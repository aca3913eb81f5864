// Access to the API: sign-in, data calls, polling, and following a job's event stream.
//
// The key is typed into the sign-in form and posted once to /v1/session, which answers with an
// HttpOnly, SameSite=Strict session cookie (a short-lived signed token naming the key). The page
// keeps no key: not in localStorage or sessionStorage (where any script on the page could read
// it), never in the URL (history, proxy and server logs, Referer headers). Every later call,
// EventSource included, authenticates with that cookie, and every call sends X-Requested-With,
// which the API requires of cookie-authenticated requests that change something: a header no
// other site can make a browser send here.

export const POLL_MS = 2000;
const STREAM_RETRY_MS = 10000; // while a stream is down the page polls, then tries it again
const CSRF = { "X-Requested-With": "grpo-dashboard" };
export const CSRF_HEADERS = CSRF; // for requests api() does not make (a streamed POST)
const LEGACY_KEY_STORE = "grpo.apiKey"; // where earlier versions kept the key

export class AuthError extends Error {}

/** The signed-in session ({project_id, project_name, key_id, expires_at}) or null. */
export let session = null;
let sessionEnded = () => {};

/** fn(message) runs when a call finds the session gone (expired, signed out, key revoked). */
export function onSessionEnd(fn) {
  sessionEnded = fn;
}

/** Who is signed in, asked of the API (the cookie is HttpOnly: the page cannot read it).
 * Returns a message when an old `?key=` link was used: such a key is not used, only scrubbed
 * from the address bar so it goes no further into history. */
export async function loadSession() {
  localStorage.removeItem(LEGACY_KEY_STORE);
  const res = await fetch("/v1/session", { cache: "no-store", headers: CSRF });
  session = res.ok ? await res.json() : null;
  const url = new URL(location.href);
  if (!url.searchParams.has("key")) return "";
  url.searchParams.delete("key");
  history.replaceState(null, "", url.pathname + url.search + url.hash);
  return "Keys in the address (?key=) are not accepted; paste the key here instead.";
}

export async function signIn(key) {
  const res = await fetch("/v1/session", {
    method: "POST", cache: "no-store",
    headers: { ...CSRF, "Content-Type": "application/json" },
    body: JSON.stringify({ key }),
  });
  const data = await res.json().catch(() => null);
  if (res.status === 401) throw new AuthError("The API key was rejected; enter a valid key.");
  if (!res.ok) throw new Error(data?.error?.message || `${res.status} ${res.statusText}`);
  session = data;
}

export async function signOut() {
  session = null;
  await fetch("/v1/session", { method: "DELETE", headers: CSRF }).catch(() => {});
}

export function qs(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v == null || v === "") continue;
    for (const item of Array.isArray(v) ? v : [v]) q.append(k, item);
  }
  return q.toString();
}

export async function api(path, { method = "GET", body, signal } = {}) {
  const headers = { ...CSRF };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path, {
    method, headers, signal, cache: "no-store",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (res.status === 401) {
    session = null;
    sessionEnded("Your session ended (it expired, or the key was revoked); sign in again.");
    throw new AuthError("unauthorized");
  }
  const data = await res.json().catch(() => null);
  if (!res.ok) throw new Error(data?.error?.message || `${res.status} ${res.statusText}`);
  return data;
}

// Event streams of the page that are open now (follow()): while one is, a read that succeeds
// does not say the page is polling.
let openStreams = 0;
const STREAMING = "Following the live event stream";

export function setConn(ok, message) {
  const el = document.getElementById("conn");
  el.className = `conn ${ok ? "ok" : "down"}`;
  el.textContent = ok ? "live" : "offline";
  const quiet = openStreams > 0 ? STREAMING : `Polling the API every ${POLL_MS / 1000} s`;
  el.title = ok ? message || quiet : message || "The API did not answer";
}

/** Run fn every POLL_MS until it returns false or stop() is called; never two runs at once. */
export function poller(fn) {
  const ctrl = new AbortController();
  let timer = null, busy = false, again = false, stopped = false;
  async function tick() {
    clearTimeout(timer);
    if (stopped) return;
    if (busy) { again = true; return; }
    busy = true;
    let keepGoing = true;
    try {
      keepGoing = (await fn(ctrl.signal)) !== false;
      setConn(true);
    } catch (err) {
      if (stopped || err.name === "AbortError" || err instanceof AuthError) return;
      setConn(false, err.message);
    } finally {
      busy = false;
    }
    if (stopped) return;
    if (again) { again = false; tick(); } else if (keepGoing) timer = setTimeout(tick, POLL_MS);
  }
  tick();
  return {
    now: tick,
    stop() { stopped = true; clearTimeout(timer); ctrl.abort(); },
  };
}

/** Follow a server-sent event stream: `on` maps event names to handlers of their parsed data.
 * `url()` is asked at every (re)connection, so it can name where the page's state ends. When
 * the stream fails (an error status such as 429 for too many open streams, a dropped
 * connection), it is closed and `poll` (a poller function) takes over until a new connection
 * opens STREAM_RETRY_MS later. An `end` message closes it for good. */
export function follow({ url, on, poll }) {
  let source = null, fallback = null, retry = null, stopped = false, counted = false;
  function counting(isOpen) {
    if (isOpen !== counted) { openStreams += isOpen ? 1 : -1; counted = isOpen; }
  }
  function open() {
    if (stopped) return;
    fallback?.stop();
    fallback = null;
    source = new EventSource(url());
    source.onopen = () => { counting(true); setConn(true, STREAMING); };
    for (const [name, handler] of Object.entries(on)) {
      source.addEventListener(name, (e) => {
        if (name === "end") { source.close(); source = null; counting(false); }
        handler(JSON.parse(e.data));
      });
    }
    source.onerror = () => {
      if (stopped || !source) return;
      source.close();
      source = null;
      counting(false);
      fallback = poller(async (signal) => {
        const keepGoing = await poll(signal);
        if (keepGoing === false) clearTimeout(retry);
        return keepGoing;
      });
      retry = setTimeout(open, STREAM_RETRY_MS);
    };
  }
  open();
  return {
    stop() {
      stopped = true;
      counting(false);
      source?.close();
      fallback?.stop();
      clearTimeout(retry);
    },
  };
}

/** Run `load` once, then again whenever the project's change stream (/v1/stream) reports that
 * one of its jobs changed (one read at a time: a change during a read asks for one more); poll
 * with it only while the stream is down. For pages that show several jobs (the list, compare). */
export function followProject(load) {
  const reload = poller(async (signal) => { await load(signal); return false; });
  const live = follow({ url: () => "/v1/stream", on: { jobs: () => reload.now() }, poll: load });
  return { now: reload.now, stop() { live.stop(); reload.stop(); } };
}
