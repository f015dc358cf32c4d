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
  if (!view.paused) {
    try {
      const r = await fetch("/debug/state", { headers: headers(false), cache: "no-store" });
      if (r.status === 401) {
        $("keyform").hidden = false;
        $("status").textContent = "API key required";
      } else if (!r.ok) {
        $("status").textContent = "error " + r.status;
      } else {
        $("keyform").hidden = true;
        render(await r.json());
      }
    } catch (e) {
      $("status").textContent = "server unreachable";
    }
  }
  setTimeout(poll, POLL_MS);
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
  view.blocks = { states, refs, owners, hashes: pool.hashes, n };
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
  return `block ${b} · ${st}\nref count ${v.refs[b]}` + (hash ? `\nprefix hash ${hash}` : "") +
    (own.length ? `\nsequences: ${own.slice(0, 12).join(", ")}${own.length > 12 ? " …" : ""}` : "");
}

function showTip(ev, text) {
  const tip = $("tip");
  if (!text) { tip.hidden = true; return; }
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = ev.clientX + 14 + "px";
  tip.style.top = ev.clientY + 14 + "px";
}

function renderSeqs(snap) {
  const box = $("seqs");
  const refs = view.blocks.refs;
  const rows = [];
  let lastReq = null;
  const seqs = snap.seqs.slice(0, MAX_ROWS);
  for (const s of seqs) {
    if (s.request_id !== lastReq) {
      const head = el("div", "group-head");
      head.textContent = s.request_id + (s.num_cached_tokens ? ` · ${s.num_cached_tokens} prompt tokens from the prefix cache` : "");
      rows.push(head);
    }
    lastReq = s.request_id;
    const row = el("div", "seq");
    row.dataset.request = s.request_id;
    const label = el("span", "label");
    label.textContent = `#${s.index} ${s.status}`;
    label.title = `${s.num_computed_tokens}/${s.num_tokens} tokens computed, prompt ${s.num_prompt_tokens}, ` +
      `${s.num_cached_tokens} from the prefix cache`;
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
      (s.opaque ? " · tenant opaque" : "") + (s.text ? " · " + s.text : "");
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

const SPARKS = [
  ["KV usage", (p) => p.usage * 100, (v) => fmt(v, 1) + " %"],
  ["generation", (p) => p.genRate, (v) => fmt(v, 1) + " tok/s"],
  ["prompt", (p) => p.promptRate, (v) => fmt(v, 1) + " tok/s"],
  ["TTFT", (p) => p.ttft, (v) => fmt(v, 1) + " ms"],
  ["TPOT", (p) => p.tpot, (v) => fmt(v, 1) + " ms"],
];

function renderSparks(hist) {
  const box = $("sparks");
  if (!box.children.length) {
    for (const [name] of SPARKS) {
      const row = el("div", "spark");
      const label = el("span", "name");
      label.textContent = name;
      const c = el("canvas");
      c.width = 220;
      c.height = 26;
      row.append(label, c, el("span", "val"));
      box.append(row);
    }
  }
  SPARKS.forEach(([, get, show], i) => {
    const row = box.children[i];
    const values = hist.map(get);
    const last = values[values.length - 1];
    row.lastChild.textContent = show(last);
    const c = row.children[1];
    const ctx = c.getContext("2d");
    ctx.clearRect(0, 0, c.width, c.height);
    const finite = values.filter((v) => v !== null && v !== undefined && isFinite(v));
    if (!finite.length) return;
    const max = Math.max(...finite, 1e-9);
    ctx.strokeStyle = "#6fb3ff";
    ctx.beginPath();
    let started = false;
    values.forEach((v, k) => {
      if (v === null || v === undefined) return;
      const x = c.width - 1 - ((values.length - 1 - k) / (HISTORY - 1)) * (c.width - 2);
      const y = c.height - 2 - (v / max) * (c.height - 4);
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    });
    ctx.stroke();
  });
}

function renderCounters(snap) {
  const c = snap.counters;
  const mem = snap.memory;
  const hitRate = c.prefix_queries ? (100 * c.prefix_hits) / c.prefix_queries : null;
  const rows = [
    ["preemptions", c.preemptions], ["copy-on-write blocks", c.cow_blocks],
    ["swapped out / in blocks", `${c.swapped_out_blocks} / ${c.swapped_in_blocks}`],
    ["prefix cache", snap.prefix_caching ? `${c.prefix_hits} of ${c.prefix_queries} tokens hit (${fmt(hitRate, 1)} %)` : "off"],
    ["prefix evictions", c.prefix_evictions],
    ["prompt / generated tokens", `${c.prompt_tokens} / ${c.generation_tokens}`],
    ["weights", fmtBytes(mem.weights)], ["KV cache", `${fmtBytes(mem.kv_cache)} (${fmtBytes(mem.per_block)} a block)`],
    ["host RSS", fmtBytes(mem.host_rss)],
  ];
  $("counters").replaceChildren(...rows.map(([k, v]) => {
    const tr = el("tr");
    const a = el("th");
    a.textContent = k;
    const b = el("td", "num");
    b.textContent = String(v);
    tr.append(a, b);
    return tr;
  }));
}

function renderRouter(router) {
  $("router-panel").hidden = !router;
  if (!router) return;
  const s = router.share;
  $("router-summary").textContent = `${router.policy}, threshold ${fmt(router.threshold, 3)} · strong share ` +
    `${fmt(s.realised_strong === null ? null : 100 * s.realised_strong, 0)} %` +
    (s.target_strong !== null ? ` (target ${fmt(100 * s.target_strong, 0)} %)` : "") +
    (router.budget ? ` · spend $${fmt(router.budget.spent, 4)} of $${fmt(router.budget.cap_per_hour, 2)}/h` : "");
  const head = el("tr");
  for (const h of ["time", "model", "tier", "score / threshold", "reason"]) {
    const th = el("th");
    th.textContent = h;
    head.append(th);
  }
  const rows = router.decisions.slice(0, 20).map((d) => {
    const tr = el("tr");
    const cells = [new Date(d.time * 1000).toLocaleTimeString(), d.model + (d.replica ? "/" + d.replica : ""),
                   d.category || (d.tier !== null ? "tier " + d.tier : ""),
                   `${fmt(d.score, 3)} / ${fmt(d.threshold, 3)}`, d.reason];
    for (const v of cells) {
      const td = el("td");
      td.textContent = v;
      tr.append(td);
    }
    return tr;
  });
  $("decisions").replaceChildren(head, ...rows);
}

function renderMoe(snap, key) {
  const layers = Object.keys(snap.moe_expert_tokens).sort((a, b) => a - b);
  $("moe-panel").hidden = !layers.length;
  if (!layers.length) return;
  const prev = view.prevMoe[key];
  view.prevMoe[key] = snap.moe_expert_tokens;
  let grid = layers.map((l) => snap.moe_expert_tokens[l].map((v, e) => v - (prev && prev[l] ? prev[l][e] : 0)));
  if (!grid.some((row) => row.some((v) => v > 0))) grid = layers.map((l) => snap.moe_expert_tokens[l]);
  const c = $("moe");
  const ctx = c.getContext("2d");
  const experts = Math.max(...grid.map((r) => r.length));
  const cw = Math.max(2, Math.floor(c.width / experts));
  const ch = Math.max(2, Math.floor(c.height / layers.length));
  ctx.clearRect(0, 0, c.width, c.height);
  grid.forEach((row, i) => {
    const max = Math.max(...row, 1);
    row.forEach((v, e) => {
      ctx.fillStyle = `hsl(25, 85%, ${8 + 55 * (v / max)}%)`;
      ctx.fillRect(e * cw, i * ch, cw - 1, ch - 1);
    });
  });
  c.title = `${layers.length} MoE layers x ${experts} experts`;
}

async function play(ev) {
  ev.preventDefault();
  const prefix = $("play-prefix").value;
  const lines = $("play-prompts").value.split("\n").filter((l) => l.trim());
  const n = Math.max(1, Number($("play-n").value) || 1);
  const beam = Math.max(0, Number($("play-beam").value) || 0);
  const body = { model: view.model, max_tokens: Math.max(1, Number($("play-max").value) || 16) };
  if (beam > 0) Object.assign(body, { use_beam_search: true, beam_width: beam, n: Math.min(n, beam), temperature: 0 });
  else Object.assign(body, { n, temperature: n > 1 ? 0.8 : 0 });
  $("play-out").textContent = `sending ${lines.length} request(s)…`;
  const results = await Promise.all(lines.map(async (line) => {
    try {
      const r = await fetch("/v1/completions", { method: "POST", headers: headers(true),
                                                 body: JSON.stringify({ ...body, prompt: prefix + " " + line }) });
      const data = await r.json();
      if (!r.ok) return `${line}: error ${r.status}: ${data.error ? data.error.message : ""}`;
      return data.choices.map((ch) => `${line} ⟶ ${ch.text}`).join("\n");
    } catch (e) {
      return `${line}: ${e}`;
    }
  }));
  $("play-out").textContent = results.join("\n");
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
