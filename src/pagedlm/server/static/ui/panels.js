// pagedlm memory view: the panels beside the block pool and the sequences (sparklines, counters, router, experts)
// and the playground. Loaded after app.js, whose helpers and `view` state they share.
"use strict";

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
  const prev = view.prevCounters && view.prevCounters.key === view.model + "/" + view.replica ? view.prevCounters.c : c;
  view.prevCounters = { key: view.model + "/" + view.replica, c };
  const since = (k) => (c[k] > prev[k] ? `${c[k]} (+${c[k] - prev[k]})` : String(c[k]));  // since the last poll
  const hitRate = c.prefix_queries ? (100 * c.prefix_hits) / c.prefix_queries : null;
  const rows = [
    ["preemptions", since("preemptions")], ["copy-on-write blocks", since("cow_blocks")],
    ["swapped out / in blocks", `${since("swapped_out_blocks")} / ${since("swapped_in_blocks")}`],
    ["prefix cache", snap.prefix_caching ? `${c.prefix_hits} of ${c.prefix_queries} tokens hit (${fmt(hitRate, 1)} %)` : "off"],
    ["prefix evictions", since("prefix_evictions")],
    ["prompt / generated tokens", `${c.prompt_tokens} / ${c.generation_tokens}`],
    ["weights", fmtBytes(mem.weights)], ["KV cache", `${fmtBytes(mem.kv_cache)} (${fmtBytes(mem.per_block)} a block)`],
    ["host RSS", fmtBytes(mem.host_rss)],
  ];
  const d = snap.draft;  // speculative decoding's draft model: its own weights and KV cache
  if (d) {
    rows.push(["draft model", d.model], ["draft weights", fmtBytes(d.weights)],
      ["draft KV cache", `${d.num_used} of ${d.num_blocks} blocks used, ${d.num_seqs} sequences (${fmtBytes(d.kv_cache)})`]);
  }
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
