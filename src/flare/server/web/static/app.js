// Flare web chat: a client of Flare's public HTTP API, no build step.
//
// Conversations are trees of messages kept in this browser (localStorage); the
// conversation state (KV pages, and for hybrid models their layer states) lives in the
// server as named sessions. Each branch has its own session: editing a user message or
// regenerating an answer forks the session it leaves (POST /v1/sessions/{name}/fork), so
// the new branch starts from a state that shares the old one's pages. Every turn is a
// streamed /v1/chat/completions request naming its session; its figures (TTFT, tokens/s,
// cached tokens and the tier the reused state came from) come from the response's usage
// and `flare` extension (server clock).
"use strict";

const STORE = "flare.web.v1";         // conversations
const KEY = "flare.apiKey";           // bearer token, asked for once on a 401
const SETTINGS = "flare.web.settings"; // optional JSON: {max_tokens, temperature, top_p}
const POLL_MS = 2000;

const $ = (id) => document.getElementById(id);
let state = loadState();
let modelId = null;
let busy = null;  // {controller, conv, node} while a reply streams
const history = [];  // status samples: {queries, hits}

// ------------------------------------------------------------------ storage

function loadState() {
  try {
    const s = JSON.parse(localStorage.getItem(STORE));
    if (s && s.convs && s.order) return s;
  } catch (e) { /* a damaged store starts afresh */ }
  return {convs: {}, order: [], current: null};
}
function saveState() { localStorage.setItem(STORE, JSON.stringify(state)); }
function uid() {
  const a = new Uint8Array(6);
  crypto.getRandomValues(a);
  return Array.from(a, (b) => b.toString(16).padStart(2, "0")).join("");
}
function settings() {
  try {
    const s = JSON.parse(localStorage.getItem(SETTINGS)) || {};
    const out = {};
    for (const k of ["max_tokens", "temperature", "top_p"]) if (typeof s[k] === "number") out[k] = s[k];
    return out;
  } catch (e) { return {}; }
}

// ------------------------------------------------------------------ HTTP

function askKey() {
  return new Promise((resolve) => {
    const dlg = $("key-dialog");
    $("key-input").value = "";
    dlg.addEventListener("close", () => {
      const key = $("key-input").value.trim();
      if (key) localStorage.setItem(KEY, key);
      resolve(Boolean(key));
    }, {once: true});
    dlg.showModal();
  });
}

// fetch with the stored key; a 401 asks for the key (once per wrong or missing key) and retries
async function api(path, opts = {}) {
  for (;;) {
    const headers = Object.assign({"Content-Type": "application/json"}, opts.headers || {});
    const key = localStorage.getItem(KEY);
    if (key) headers.Authorization = "Bearer " + key;
    const res = await fetch(path, Object.assign({}, opts, {headers}));
    if (res.status !== 401) return res;
    localStorage.removeItem(KEY);
    if (!(await askKey())) return res;
  }
}
async function errorText(res) {
  try {
    const body = await res.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) { return `HTTP ${res.status}`; }
}
function showError(text) {
  const box = $("error");
  box.textContent = text || "";
  box.hidden = !text;
}

// Server-sent events of a streamed response: calls onEvent(obj) per `data:` JSON
async function readSSE(res, onEvent) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

// ------------------------------------------------------------------ the message tree

function current() { return state.convs[state.current] || null; }
function newConv() {
  const id = uid();
  const conv = {id, title: "", system: "", nodes: {}, roots: [], rootActive: 0, seq: 0,
                sessions: {}, updated: Date.now()};
  state.convs[id] = conv;
  state.order.unshift(id);
  state.current = id;
  saveState();
  return conv;
}
function siblings(conv, node) { return node.parent ? conv.nodes[node.parent].children : conv.roots; }
function activePath(conv) {
  const out = [];
  let list = conv.roots, idx = conv.rootActive;
  while (list.length) {
    const node = conv.nodes[list[Math.min(idx, list.length - 1)]];
    out.push(node);
    list = node.children;
    idx = node.active;
  }
  return out;
}
function addNode(conv, parentId, role, content) {
  const node = {id: uid(), role, content, parent: parentId, children: [], active: 0,
                session: null, stats: null, finish: null};
  conv.nodes[node.id] = node;
  const list = parentId ? conv.nodes[parentId].children : conv.roots;
  list.push(node.id);
  if (parentId) conv.nodes[parentId].active = list.length - 1; else conv.rootActive = list.length - 1;
  conv.updated = Date.now();
  return node;
}
function select(conv, node, step) {
  const list = siblings(conv, node);
  const i = (list.indexOf(node.id) + step + list.length) % list.length;
  if (node.parent) conv.nodes[node.parent].active = i; else conv.rootActive = i;
  saveState();
  render();
  refreshSessions();  // the list shows the state of the branch now shown
}
function lastAssistant(path) {
  for (let i = path.length - 1; i >= 0; i--) if (path[i].role === "assistant" && path[i].session) return path[i];
  return null;
}
function convSession(conv) {
  const a = lastAssistant(activePath(conv));
  return a ? a.session : null;
}
function messagesBefore(conv, node) {
  const path = activePath(conv);
  const msgs = conv.system ? [{role: "system", content: conv.system}] : [];
  for (const n of path) {
    if (n.id === node.id) break;
    msgs.push({role: n.role, content: n.content});
  }
  return msgs;
}

// The session a new request continues in: the previous answer's own session while that
// session still ends at it; otherwise a fork of `base` (a branch leaves it), sharing its
// pages; a new name when there is nothing to fork (first turn, or the state is gone).
async function sessionFor(conv, prev, base) {
  if (prev && prev.session && conv.sessions[prev.session] === prev.id && base === prev.session) {
    return prev.session;
  }
  const name = `web-${conv.id}-${++conv.seq}`;
  if (base) {
    const res = await api(`/v1/sessions/${encodeURIComponent(base)}/fork`,
                          {method: "POST", body: JSON.stringify({id: name})});
    if (res.ok) conv.sessions[name] = conv.sessions[base] || null;
  }
  return name;
}

// ------------------------------------------------------------------ generation

async function send(text) {
  const conv = current() || newConv();
  if (!conv.title) conv.title = text.slice(0, 48);
  const path = activePath(conv);
  const last = path[path.length - 1] || null;
  const prev = lastAssistant(path);
  const session = await sessionFor(conv, last && last.role === "assistant" ? last : null,
                                   prev ? prev.session : null);
  const user = addNode(conv, last ? last.id : null, "user", text);
  const reply = addNode(conv, user.id, "assistant", "");
  await generate(conv, reply, session);
}

async function editUser(conv, node, text) {
  const base = convSession(conv);  // the branch being left
  const session = await sessionFor(conv, null, base);
  const user = addNode(conv, node.parent, "user", text);
  const reply = addNode(conv, user.id, "assistant", "");
  await generate(conv, reply, session);
}

async function regenerate(conv, node) {
  const session = await sessionFor(conv, null, node.session || convSession(conv));
  const reply = addNode(conv, node.parent, "assistant", "");
  await generate(conv, reply, session);
}

async function continueReply(conv, node) {
  const res = await api("/api/web/continuation", {method: "POST", body: JSON.stringify(
    {messages: messagesBefore(conv, node), partial: node.content})});
  if (!res.ok) { showError(await errorText(res)); return; }
  const {prompt_token_ids: prompt} = await res.json();
  const session = await sessionFor(conv, node, node.session);
  await stream(conv, node, session, "/v1/completions", {prompt},
               (choice) => choice.text || "");
}

function generate(conv, node, session) {
  return stream(conv, node, session, "/v1/chat/completions",
                {messages: messagesBefore(conv, node)},
                (choice) => (choice.delta && choice.delta.content) || "");
}

// One streamed request appending to `node.content`; figures from usage + `flare`.
async function stream(conv, node, session, path, body, textOf) {
  showError("");
  const controller = new AbortController();
  busy = {controller, conv, node};
  node.finish = null;
  node.session = session;
  saveState();
  render();
  const started = performance.now();
  let firstAt = null, usage = null, flare = null;
  try {
    const res = await api(path, {method: "POST", signal: controller.signal, body: JSON.stringify(
      Object.assign({model: modelId, stream: true, stream_options: {include_usage: true},
                     session}, settings(), body))});
    if (!res.ok) throw new Error(await errorText(res));
    await readSSE(res, (ev) => {
      if (ev.error) throw new Error(ev.error.message || "generation failed");
      for (const choice of ev.choices || []) {
        const text = textOf(choice);
        if (text) {
          if (firstAt === null) firstAt = performance.now();
          node.content += text;
          paint(node);
        }
        if (choice.finish_reason) node.finish = choice.finish_reason;
      }
      if (ev.usage) usage = ev.usage;
      if (ev.flare) flare = ev.flare;
    });
    conv.sessions[session] = node.id;  // the session's state now ends with this answer
  } catch (e) {
    if (e.name === "AbortError") {
      node.finish = "stopped";
      conv.sessions[session] = null;  // an aborted request may or may not have moved it
    } else {
      node.finish = node.finish || "error";
      showError(String(e.message || e));
    }
  } finally {
    busy = null;
  }
  node.stats = figures(usage, flare, started, firstAt);
  saveState();
  render();
  refreshSessions();
}

function figures(usage, flare, started, firstAt) {
  const s = {client_ttft_ms: firstAt !== null ? firstAt - started : null};
  if (usage) {
    s.prompt_tokens = usage.prompt_tokens;
    s.completion_tokens = usage.completion_tokens;
    s.cached_tokens = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
  }
  const c = flare && flare.choices && flare.choices[0];
  if (c) {
    const t = c.timings;
    if (t.first_token_ns != null) s.ttft_ms = (t.first_token_ns - t.arrival_ns) / 1e6;
    if (t.finished_ns != null && t.first_token_ns != null && s.completion_tokens > 1) {
      const decode_s = (t.finished_ns - t.first_token_ns) / 1e9;
      if (decode_s > 0) s.tokens_per_s = (s.completion_tokens - 1) / decode_s;
    }
    if (c.reuse) s.tier = c.reuse.tier || (c.reuse.reused_tokens > 0 ? "device" : null);
  }
  return s;
}

// ------------------------------------------------------------------ rendering

function markdown(text) {
  return DOMPurify.sanitize(marked.parse(text || ""));
}
function highlight(el) {
  el.querySelectorAll("pre code").forEach((code) => {
    if (!code.dataset.highlighted) hljs.highlightElement(code);
  });
}
let paintPending = new Set();
function paint(node) {  // coalesce repaints of a streaming answer to one per frame
  if (paintPending.has(node.id)) return;
  paintPending.add(node.id);
  requestAnimationFrame(() => {
    paintPending.delete(node.id);
    const body = document.querySelector(`.msg[data-node="${node.id}"] .body`);
    if (body) { body.innerHTML = markdown(node.content); highlight(body); }
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  });
}

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const kid of kids) if (kid != null) e.append(kid);
  return e;
}
function fmtBytes(n) {
  if (n == null) return "-";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function statsLine(s) {
  if (!s) return null;
  const parts = [];
  const item = (label, value, cls) => {
    const b = el("b", {class: cls}, value);
    parts.push(el("span", {}, label + " ", b));
  };
  if (s.ttft_ms != null) item("TTFT", `${Math.round(s.ttft_ms)} ms`, "ttft");
  if (s.tokens_per_s != null) item("", `${s.tokens_per_s.toFixed(1)} tok/s`, "tps");
  if (s.prompt_tokens != null) {
    item("cached", String(s.cached_tokens), "cached");
    parts.push(el("span", {}, `of ${s.prompt_tokens} prompt tokens`));
    item("from", s.cached_tokens > 0 ? (s.tier || "device") : "none", "tier");
  }
  if (s.completion_tokens != null) item("", `${s.completion_tokens} tokens`, "completion");
  const line = el("div", {class: "stats"});
  parts.forEach((p, i) => { if (i) line.append(" · "); line.append(p); });
  return line;
}

function branchSwitch(conv, node) {
  const list = siblings(conv, node);
  if (list.length < 2) return null;
  const pos = list.indexOf(node.id) + 1;
  return el("span", {class: "branches"},
            el("button", {class: "prev", type: "button", title: "previous branch",
                          onclick: () => !busy && select(conv, node, -1)}, "‹"),
            el("span", {class: "branch-pos"}, `${pos}/${list.length}`),
            el("button", {class: "next", type: "button", title: "next branch",
                          onclick: () => !busy && select(conv, node, +1)}, "›"));
}

function messageView(conv, node, isLast) {
  const streaming = busy && busy.node.id === node.id;
  const cls = `msg ${node.role}${streaming ? " streaming" : ""}${!streaming && node.finish ? " done" : ""}`;
  const body = el("div", {class: "body"});
  if (node.role === "user") body.textContent = node.content;
  else { body.innerHTML = markdown(node.content); highlight(body); }
  const tools = el("div", {class: "tools"});
  if (!busy) {
    if (node.role === "user") {
      tools.append(el("button", {class: "edit", type: "button", onclick: () => startEdit(conv, node)}, "Edit"));
    } else {
      tools.append(el("button", {class: "regenerate", type: "button",
                                 onclick: () => regenerate(conv, node)}, "Regenerate"));
    }
  }
  if (node.role === "assistant" && node.finish && node.finish !== "stop") {
    tools.append(el("span", {class: "muted finish"}, `(${node.finish})`));
  }
  const who = el("div", {class: "who"}, node.role === "user" ? "You" : "Assistant",
                 branchSwitch(conv, node));
  return el("div", {class: cls, "data-node": node.id}, who, body,
            node.role === "assistant" ? statsLine(node.stats) : null, tools);
}

function startEdit(conv, node) {
  const view = document.querySelector(`.msg[data-node="${node.id}"]`);
  const area = el("textarea", {rows: "3"});
  area.value = node.content;
  const box = el("div", {class: "edit-box"}, area,
                 el("button", {class: "save-edit", type: "button", onclick: () => {
                   const text = area.value.trim();
                   if (text) editUser(conv, node, text);
                 }}, "Send as a new branch"),
                 el("button", {type: "button", onclick: render}, "Cancel"));
  view.querySelector(".body").replaceWith(box);
  area.focus();
}

function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const id of state.order) {
    const conv = state.convs[id];
    const srv = conv.server;
    const note = !srv ? "" : srv.missing ? "no state" :
      `${srv.tokens} tok${srv.saved_tokens ? " · saved" : ""}`;
    ul.append(el("li", {class: id === state.current ? "current" : "", "data-conv": id,
                        onclick: () => { if (!busy) { state.current = id; saveState(); render(); } }},
                 el("span", {class: "conv-title"}, conv.title || "New chat"),
                 el("span", {class: "conv-state"}, note),
                 el("button", {class: "del", type: "button", title: "delete",
                               onclick: (e) => { e.stopPropagation(); deleteConv(id); }}, "×")));
  }
}

function render() {
  renderList();
  const conv = current();
  $("title").value = conv ? conv.title : "";
  $("system").value = conv ? conv.system : "";
  const session = conv ? convSession(conv) : null;
  $("session-name").textContent = session ? `session ${session}` : "";
  $("save-state").hidden = !session;
  const box = $("messages");
  box.replaceChildren();
  const path = conv ? activePath(conv) : [];
  path.forEach((node, i) => box.append(messageView(conv, node, i === path.length - 1)));
  box.scrollTop = box.scrollHeight;
  const last = path[path.length - 1];
  $("send").disabled = Boolean(busy);
  $("stop").hidden = !busy;
  $("continue").hidden = Boolean(busy) || !last || last.role !== "assistant" ||
    !["stopped", "length"].includes(last.finish);
}

async function deleteConv(id) {
  const conv = state.convs[id];
  for (const name of Object.keys(conv.sessions)) {
    await api(`/v1/sessions/${encodeURIComponent(name)}`, {method: "DELETE"}).catch(() => null);
  }
  delete state.convs[id];
  state.order = state.order.filter((x) => x !== id);
  if (state.current === id) state.current = state.order[0] || null;
  saveState();
  render();
}

// what the server holds for each conversation's current branch
async function refreshSessions() {
  for (const id of state.order.slice(0, 30)) {
    const conv = state.convs[id];
    const name = convSession(conv);
    if (!name) continue;
    try {
      const res = await api(`/v1/sessions/${encodeURIComponent(name)}`);
      conv.server = res.ok ? await res.json() : (res.status === 404 ? {missing: true} : conv.server);
    } catch (e) { /* server away: keep the last figures */ }
  }
  saveState();
  renderList();
}

// ------------------------------------------------------------------ status view

async function pollStatus() {
  if (document.hidden) return;
  let s;
  try {
    const res = await api("/debug/state");
    if (!res.ok) return;
    s = await res.json();
  } catch (e) { return; }
  const used = s.pages_used, total = s.pages_total;
  $("st-pages").textContent = `${used} used · ${s.pages_free} free`;
  $("st-pages-bar").style.width = total ? `${(100 * used) / total}%` : "0";
  $("st-pinned").textContent = s.session_pinned_pages != null ?
    `${s.session_pinned_pages} / ${s.session_pinned_budget_pages} pages` : "-";
  $("st-host").textContent = s.host_tier_budget_bytes != null ?
    `${fmtBytes(s.host_tier_bytes)} / ${fmtBytes(s.host_tier_budget_bytes)}` : "none";
  $("st-disk").textContent = s.disk_tier_bytes != null ?
    `${fmtBytes(s.disk_tier_bytes)} · ${s.disk_tier_records} records` : "none";
  const q = s.prefix_cache_queries_total || 0, h = s.prefix_cache_hits_total || 0;
  $("st-hit").textContent = q ? `${((100 * h) / q).toFixed(1)} %` : "-";
  history.push({queries: q, hits: h});
  if (history.length > 90) history.shift();
  drawPlot();
}

function drawPlot() {
  const canvas = $("st-plot");
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  g.strokeStyle = "#e1e5ea";
  for (const y of [0.25, 0.5, 0.75]) { g.beginPath(); g.moveTo(0, h * y); g.lineTo(w, h * y); g.stroke(); }
  const n = 90, step = w / n;
  const x0 = w - history.length * step;
  g.fillStyle = "rgba(217, 72, 15, 0.35)";
  for (let i = 1; i < history.length; i++) {
    const dq = history[i].queries - history[i - 1].queries;
    if (dq <= 0) continue;
    const r = (history[i].hits - history[i - 1].hits) / dq;
    g.fillRect(x0 + i * step, h * (1 - r), Math.max(1, step - 1), h * r);
  }
  g.strokeStyle = "#d9480f";
  g.lineWidth = 1.5;
  g.beginPath();
  let started = false;
  history.forEach((p, i) => {
    if (!p.queries) return;
    const y = h * (1 - p.hits / p.queries);
    if (started) g.lineTo(x0 + i * step, y); else { g.moveTo(x0 + i * step, y); started = true; }
  });
  g.stroke();
}

// ------------------------------------------------------------------ wiring

function bind() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || busy) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => busy && busy.controller.abort());
  $("continue").addEventListener("click", () => {
    const conv = current();
    const path = activePath(conv);
    if (!busy) continueReply(conv, path[path.length - 1]);
  });
  $("new-chat").addEventListener("click", () => { if (!busy) { newConv(); render(); $("input").focus(); } });
  $("title").addEventListener("input", () => {
    const conv = current();
    if (conv) { conv.title = $("title").value; saveState(); renderList(); }
  });
  $("system").addEventListener("input", () => {
    const conv = current() || newConv();
    conv.system = $("system").value;
    saveState();
  });
  $("save-state").addEventListener("click", async () => {
    const conv = current();
    const name = conv && convSession(conv);
    if (!name) return;
    const res = await api(`/v1/sessions/${encodeURIComponent(name)}/save`, {method: "POST"});
    showError(res.ok ? "" : await errorText(res));
    refreshSessions();
  });
}

async function main() {
  bind();
  render();
  try {
    const res = await api("/v1/models");
    if (res.ok) {
      const body = await res.json();
      modelId = body.data[0].id;
      $("model-name").textContent = modelId;
    } else {
      showError(await errorText(res));
    }
  } catch (e) { showError(`server unreachable: ${e}`); }
  refreshSessions();
  pollStatus();
  setInterval(pollStatus, POLL_MS);
}

main();
