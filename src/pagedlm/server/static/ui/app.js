// pagedlm memory view: polls GET /debug/state (at most every POLL_MS) and draws the block pool, the sequences'
// block tables, live sparklines, counters, the router's decisions and the MoE expert heatmap. Read-only; the
// playground sends ordinary /v1/completions requests with the same key.
"use strict";

const POLL_MS = 500;
const HISTORY = 120;
const MAX_ROWS = 128;
const MAX_CELLS = 256;
const COLORS = { free: "#2a3038", cached: "#3b6fb6", used: "#3fa45b", shared: "#e08a2c", hl: "#ffffff" };

const $ = (id) => document.getElementById(id);
const view = { model: null, replica: null, paused: false, history: {}, prevMoe: {}, last: null, owners: null,
               cells: 0, cols: 0, blocks: null };

function apiKey() {
  const m = location.hash.match(/key=([^&]+)/);
  if (m) {
    sessionStorage.setItem("pagedlm-key", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem("pagedlm-key");
}

function headers(json) {
  const h = {};
  const key = apiKey();
  if (key) h.Authorization = "Bearer " + key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

function expand(runs, n) {
  const out = new Int32Array(n);
  let i = 0;
  for (let r = 0; r < runs.length; r += 2) {
    out.fill(runs[r], i, i + runs[r + 1]);
    i += runs[r + 1];
  }
  return out;
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return b.toFixed(i ? 1 : 0) + " " + u[i];
}

function fmt(v, digits) {
  return v === null || v === undefined ? "–" : Number(v).toFixed(digits === undefined ? 0 : digits);
}

async function poll() {
  try {
    if (!view.paused) await refresh();
  } finally {  // a drawing error reaches the console, and polling goes on
    setTimeout(poll, POLL_MS);
  }
}

async function refresh() {
  let r;
  try {
    r = await fetch("/debug/state", { headers: headers(false), cache: "no-store" });
  } catch (e) {
    $("status").textContent = "server unreachable";
    return;
  }
  if (r.status === 401) {
    $("keyform").hidden = false;
    $("status").textContent = "API key required";
  } else if (!r.ok) {
    $("status").textContent = "error " + r.status;
  } else {
    $("keyform").hidden = true;
    render(await r.json());
  }
}

function fillSelect(sel, names, current) {
  const want = names.join("\n");
  if (sel.dataset.names !== want) {
    sel.replaceChildren(...names.map((n) => new Option(n, n)));
    sel.dataset.names = want;
  }
  sel.value = names.includes(current) ? current : names[0];
  return sel.value;
}

function render(state) {
  const models = Object.keys(state.models);
  view.model = fillSelect($("model"), models, view.model);
  const m = state.models[view.model];
  view.replica = fillSelect($("replica"), Object.keys(m.replicas), view.replica);
  $("replica").parentElement.hidden = Object.keys(m.replicas).length < 2;
  const snap = m.replicas[view.replica];
  $("status").textContent = "updated " + new Date(state.time * 1000).toLocaleTimeString() +
    (state.show_text ? "" : " · text hidden");
  renderRouter(state.router);
  if (!snap || snap.error) {
    $("pool-summary").textContent = snap ? snap.error : "no data";
    return;
  }
  const hist = record(view.model + "/" + view.replica, snap, m.latency);
  renderPool(snap);
  renderSeqs(snap);
  renderSparks(hist);
  renderCounters(snap);
  renderMoe(snap, view.model + "/" + view.replica);
  view.last = snap;
}

function record(key, snap, latency) {
  const h = view.history[key] || (view.history[key] = []);
  const prev = h[h.length - 1];
  const c = snap.counters;
  const point = { t: snap.time, gen: c.generation_tokens, prompt: c.prompt_tokens,
                  usage: snap.device.num_used / Math.max(1, snap.device.num_blocks),
                  ttft: latency.ttft_ms, tpot: latency.tpot_ms, genRate: 0, promptRate: 0 };
  if (prev && point.t > prev.t) {
    point.genRate = Math.max(0, (point.gen - prev.gen) / (point.t - prev.t));
    point.promptRate = Math.max(0, (point.prompt - prev.prompt) / (point.t - prev.t));
  }
  h.push(point);
  if (h.length > HISTORY) h.shift();
  return h;
}

function renderPool(snap) {
  const pool = snap.device;
  const n = pool.num_blocks;
  const states = expand(pool.state_runs, n);
  const refs = expand(pool.ref_runs, n);
  const owners = new Map();
  for (const s of snap.seqs) {
    if (s.status === "swapped") continue;
    s.block_tables.forEach((table, g) => table.forEach((b) => {
      if (b < 0) return;
      if (!owners.has(b)) owners.set(b, []);
      owners.get(b).push(s.request_id + "#" + s.index + (snap.num_groups > 1 ? " g" + g : ""));
    }));
  }
  let shared = 0;
  for (let b = 0; b < n; b++) if (refs[b] > 1) shared++;
  view.blocks = { states, refs, owners, hashes: pool.hashes, texts: pool.texts || {}, n };
  $("shared-count").dataset.shared = String(shared);
  $("shared-count").textContent = shared + " shared block" + (shared === 1 ? "" : "s");
  $("pool-summary").textContent = `${n} blocks of ${snap.block_size} tokens (${snap.kv_dtype}) · ` +
    `${pool.num_used} in use · ${pool.num_cached} cached · ${pool.num_free} free`;
  $("host-pool").textContent = snap.host ? `host swap space: ${snap.host.num_used} of ${snap.host.num_blocks} ` +
    `blocks in use` : "";
  const canvas = $("blockmap");
  const width = canvas.parentElement.clientWidth - 20;
  const cell = Math.max(3, Math.min(14, Math.floor(Math.sqrt((width * 260) / Math.max(1, n)))));
  const cols = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(n / cols);
  canvas.width = cols * cell;
  canvas.height = Math.max(cell, rows * cell);
  view.cell = cell;
  view.cols = cols;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const gap = cell > 4 ? 1 : 0;
  for (let b = 0; b < n; b++) {
    const st = states[b];
    ctx.fillStyle = st === 0 ? COLORS.free : st === 2 ? COLORS.cached : refs[b] > 1 ? COLORS.shared : COLORS.used;
    ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - gap, cell - gap);
  }
}

function blockTip(b) {
  const v = view.blocks;
  if (!v || b < 0 || b >= v.n) return null;
  const st = ["free", "in use", "cached"][v.states[b]];
  const own = v.owners.get(b) || [];
  const hash = v.hashes[String(b)];
  const text = v.texts[String(b)];
  return `block ${b} · ${st}\nref count ${v.refs[b]}` + (hash ? `\nprefix hash ${hash}` : "") +
    (own.length ? `\nsequences: ${own.slice(0, 12).join(", ")}${own.length > 12 ? " …" : ""}` : "") +
    (text !== undefined ? `\ntokens: ${JSON.stringify(text)}` : "");
}

function showTip(ev, text) {
  const tip = $("tip");
  if (!text) { tip.hidden = true; return; }
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = ev.clientX + 14 + "px";
  tip.style.top = ev.clientY + 14 + "px";
}

// Each sequence's tree glyphs; `seqs` in the snapshot's tree order (a parent before its children).
function treePrefixes(seqs) {
  const left = new Map();  // parent seq_id -> children not drawn yet
  for (const s of seqs) {
    if (s.parent !== null && s.parent !== undefined) left.set(s.parent, (left.get(s.parent) || 0) + 1);
  }
  const below = new Map();  // seq_id -> what its children's glyphs start with
  return seqs.map((s) => {
    if (s.parent === null || s.parent === undefined || !below.has(s.parent)) {
      below.set(s.seq_id, "");
      return "";
    }
    left.set(s.parent, left.get(s.parent) - 1);
    const last = left.get(s.parent) === 0;
    below.set(s.seq_id, below.get(s.parent) + (last ? "   " : "│  "));
    return below.get(s.parent) + (last ? "└─ " : "├─ ");
  });
}

function renderSeqs(snap) {
  const box = $("seqs");
  const refs = view.blocks.refs;
  const rows = [];
  let lastReq = null;
  const trees = treePrefixes(snap.seqs);
  const byId = new Map(snap.seqs.map((s) => [s.seq_id, s]));
  const seqs = snap.seqs.slice(0, MAX_ROWS);
  for (const [k, s] of seqs.entries()) {
    if (s.request_id !== lastReq) {
      const head = el("div", "group-head");
      head.textContent = s.request_id + (s.num_cached_tokens ? ` · ${s.num_cached_tokens} prompt tokens from the prefix cache` : "");
      rows.push(head);
    }
    lastReq = s.request_id;
    const row = el("div", "seq");
    row.dataset.request = s.request_id;
    row.dataset.seq = String(s.seq_id);
    const parent = s.parent === null || s.parent === undefined ? null : byId.get(s.parent);
    if (parent) row.dataset.parent = String(s.parent);
    const label = el("span", "label");
    const tree = el("span", "tree");
    tree.textContent = trees[k];
    label.append(tree, `#${s.index} ${s.status}`);
    label.title = `${s.num_computed_tokens}/${s.num_tokens} tokens computed, prompt ${s.num_prompt_tokens}, ` +
      `${s.num_cached_tokens} from the prefix cache` +
      (parent ? `\nforked from #${parent.index}, sharing its first ${s.forked_at} tokens` : "");
    row.append(label);
    const cells = el("span", "cells");
    const table = s.block_tables[0] || [];
    for (const b of table.slice(0, MAX_CELLS)) {
      const c = el("i", "blk");
      c.dataset.block = String(b);
      if (b < 0) c.classList.add("null");
      else if (s.status !== "swapped" && refs[b] > 1) {
        c.classList.add("shared");
        c.style.background = `hsl(${(b * 47) % 360}, 70%, 55%)`;
      }
      cells.append(c);
    }
    row.append(cells);
    const info = el("span", "text");
    info.textContent = `${s.num_computed_tokens}/${s.num_tokens} tok` + (table.length > MAX_CELLS ? ` (+${table.length - MAX_CELLS} blocks)` : "") +
      (parent ? ` · forked at token ${s.forked_at}` : "") + (s.opaque ? " · tenant opaque" : "") +
      (s.text ? " · " + s.text : "");
    row.append(info);
    rows.push(row);
  }
  box.replaceChildren(...rows);
  const reqs = new Set(snap.seqs.map((s) => s.request_id)).size;
  const q = snap.queues;
  $("seq-summary").textContent = `${snap.seqs.length} sequences of ${reqs} requests · running ${q.running}, ` +
    `waiting ${q.waiting}, swapped ${q.swapped}` + (snap.seqs.length > MAX_ROWS ? ` (first ${MAX_ROWS} shown)` : "");
}

function el(tag, cls) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  return e;
}

function init() {
  apiKey();
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("pagedlm-key", $("key").value);
    $("key").value = "";
    $("keyform").hidden = true;
  });
  $("pause").addEventListener("click", () => {
    view.paused = !view.paused;
    $("pause").textContent = view.paused ? "resume" : "pause";
  });
  $("model").addEventListener("change", (ev) => { view.model = ev.target.value; });
  $("replica").addEventListener("change", (ev) => { view.replica = ev.target.value; });
  $("play").addEventListener("submit", play);
  const canvas = $("blockmap");
  canvas.addEventListener("mousemove", (ev) => {
    const rect = canvas.getBoundingClientRect();
    const scale = canvas.width / rect.width;
    const x = Math.floor(((ev.clientX - rect.left) * scale) / view.cell);
    const y = Math.floor(((ev.clientY - rect.top) * scale) / view.cell);
    showTip(ev, x < view.cols ? blockTip(y * view.cols + x) : null);
  });
  canvas.addEventListener("mouseleave", () => showTip(null, null));
  const seqs = $("seqs");
  seqs.addEventListener("mouseover", (ev) => {
    const b = ev.target.dataset && ev.target.dataset.block;
    seqs.querySelectorAll(".blk.hl").forEach((e) => e.classList.remove("hl"));
    if (b === undefined) { showTip(ev, null); return; }
    seqs.querySelectorAll(`.blk[data-block="${b}"]`).forEach((e) => e.classList.add("hl"));
    showTip(ev, Number(b) < 0 ? "freed sliding-window block" : blockTip(Number(b)));
  });
  seqs.addEventListener("mouseleave", (ev) => showTip(ev, null));
  poll();
}

document.addEventListener("DOMContentLoaded", init);
