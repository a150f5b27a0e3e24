"""``GET /blocks``: one self-contained HTML page (inline CSS and JS, nothing fetched from
elsewhere) that draws every KV block as a cell and redraws it from ``blocks.json`` (a relative
URL, so the page works wherever the app is mounted) four times a second.

Cells: free (dim), cached by the prefix cache (blue, evictable), used (the colour of the request
holding it; the fill bar shows written slots; a white ring marks a block with several holders),
swapping (orange, a copy in flight). Hover a cell for its holders; the table lists the requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncpaged.engine.stats import EngineStatistics
from asyncpaged.sched.block_map import BlockMap, BlockState, PoolBlockMap

__all__ = ["PAGE", "block_map_json"]

_CODES = {BlockState.CACHED: "c", BlockState.USED: "u", BlockState.SWAPPING: "s"}


def block_map_json(snapshot: BlockMap, stats: EngineStatistics) -> dict[str, Any]:
    """The page's data: non-free blocks only, as ``[id, state, ref_cnt, filled, [holder]]``
    with holders as indices into ``holders`` (request ids, ``pin:<id>``, ``seq:<id>``)."""
    names: dict[str, int] = {}
    for request in snapshot.requests:
        names.setdefault(request.request_id, len(names))

    def pool(p: PoolBlockMap) -> dict[str, Any]:
        blocks = []
        for block, state in enumerate(p.states):
            if state is BlockState.FREE:
                continue
            holders = [names.setdefault(h, len(names)) for h in p.holders.get(block, ())]
            blocks.append([block, _CODES[state], p.ref_cnt[block], p.num_filled[block], holders])
        counts = {s.value: p.count(s) for s in BlockState}
        return {"num_blocks": p.num_blocks, "counts": counts, "blocks": blocks}

    device, host = pool(snapshot.device), pool(snapshot.host)
    queries = stats.prefix_cache_query_tokens
    return {
        "block_size": snapshot.block_size,
        "device": device,
        "host": host,
        "holders": list(names),
        "requests": [
            {
                "id": r.request_id,
                "status": r.status,
                "num_seqs": r.num_seqs,
                "num_device_blocks": r.num_device_blocks,
                "num_host_blocks": r.num_host_blocks,
            }
            for r in snapshot.requests
        ],
        "stats": _stats(stats, queries),
    }


def _stats(stats: EngineStatistics, queries: int) -> Mapping[str, float]:
    return {
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "swapped": stats.num_swapped,
        "preemptions": stats.num_preemptions,
        "swap_outs": stats.num_swap_outs,
        "swap_ins": stats.num_swap_ins,
        "finished": stats.num_finished,
        "aborted": stats.num_aborted,
        "steps": stats.num_steps,
        "prefix_hit_rate": stats.prefix_cache_hit_tokens / queries if queries else 0.0,
    }


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>asyncpaged · KV block map</title>
<style>
:root { --bg:#0f1218; --panel:#171b24; --line:#262c38; --text:#d8dee9; --dim:#7c8596;
  --free:#222834; --cached:#3d6fa8; --swap:#f0932b; }
* { box-sizing:border-box; }
body { margin:0; background:var(--bg); color:var(--text);
  font:13px/1.4 ui-sans-serif, system-ui, -apple-system, "Segoe UI", sans-serif; }
header { display:flex; align-items:baseline; gap:18px; padding:14px 20px;
  border-bottom:1px solid var(--line); flex-wrap:wrap; }
h1 { font-size:17px; margin:0; font-weight:600; letter-spacing:.2px; }
h1 small { color:var(--dim); font-weight:400; margin-left:6px; }
.stats { display:flex; gap:14px; flex-wrap:wrap; color:var(--dim); }
.stats b { color:var(--text); font-weight:600; font-variant-numeric:tabular-nums; }
#live { width:8px; height:8px; border-radius:50%; background:#3fb950; display:inline-block;
  margin-right:6px; }
#live.stale { background:#f85149; }
main { display:grid; grid-template-columns:minmax(0,1fr) 400px; gap:16px; padding:16px 20px; }
section { background:var(--panel); border:1px solid var(--line); border-radius:8px;
  padding:12px 14px; margin-bottom:16px; }
h2 { font-size:13px; margin:0 0 10px; font-weight:600; display:flex; gap:12px;
  align-items:baseline; flex-wrap:wrap; }
h2 span { color:var(--dim); font-weight:400; }
.grid { display:grid; gap:2px; grid-template-columns:repeat(auto-fill, var(--cell));
  grid-auto-rows:var(--cell); }
.blk { border-radius:2px; background:var(--free); position:relative; overflow:hidden; }
.blk.cached { background:repeating-linear-gradient(135deg, #3a587f 0 2px, #28374d 2px 4px); }
.blk.used { background:linear-gradient(to top, var(--c) var(--f), color-mix(in srgb, var(--c)
  35%, var(--free)) var(--f)); }
.blk.shared { box-shadow:inset 0 0 0 1.5px #fff; }
.grid.focus .blk:not(.hot) { opacity:.18; }
.bar { display:flex; height:6px; border-radius:3px; overflow:hidden; background:var(--free);
  margin:0 0 10px; }
.bar i { display:block; height:100%; transition:width .25s; }
.blk.swapping { background:var(--swap); animation:pulse .8s ease-in-out infinite alternate; }
@keyframes pulse { from { opacity:1; } to { opacity:.45; } }
.legend { display:flex; gap:14px; flex-wrap:wrap; color:var(--dim); margin:4px 0 10px; }
.legend i { display:inline-block; width:11px; height:11px; border-radius:2px;
  vertical-align:-1px; margin-right:5px; }
table { width:100%; border-collapse:collapse; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:3px 4px; border-bottom:1px solid var(--line); }
th { color:var(--dim); font-weight:500; }
td.n, th.n { text-align:right; }
td .sw { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:6px;
  vertical-align:-1px; }
td.id { white-space:nowrap; font-family:ui-monospace, SFMono-Regular, Menlo, monospace;
  font-size:12px; }
tbody tr { cursor:default; }
tbody tr:hover td { background:#1f2530; }
.st { font-size:11px; padding:1px 6px; border-radius:9px; background:#2a3140; }
.st.running { background:#1f3d2a; color:#7ee2a0; }
.st.waiting { background:#3a3320; color:#e8c66a; }
.st.swapped, .st.swapping_out, .st.swapping_in { background:#40291a; color:#f3a45f; }
.empty { color:var(--dim); padding:6px 0; }
#tip { position:fixed; pointer-events:none; background:#0b0d12; border:1px solid var(--line);
  border-radius:6px; padding:6px 8px; font-size:12px; display:none; max-width:320px;
  white-space:pre-line; z-index:10; }
</style></head>
<body>
<header>
  <h1><span id="live"></span>KV block map<small id="sub">connecting…</small></h1>
  <div class="stats" id="stats"></div>
</header>
<main>
  <div>
    <section><h2>Device blocks <span id="dev-sum"></span></h2>
      <div class="legend">
        <span><i style="background:var(--free)"></i>free</span>
        <span><i style="background:repeating-linear-gradient(135deg, #3a587f 0 2px,
          #28374d 2px 4px)"></i>cached (prefix cache, evictable)</span>
        <span><i style="background:#8fbf5a"></i>used (request colour, fill = slots)</span>
        <span><i style="background:#8fbf5a;box-shadow:inset 0 0 0 1.5px #fff"></i>shared</span>
        <span><i style="background:var(--swap)"></i>swap in flight</span>
      </div>
      <div class="bar" id="device-bar"></div><div class="grid" id="device"></div></section>
    <section><h2>Host (swap) blocks <span id="host-sum"></span></h2>
      <div class="bar" id="host-bar"></div><div class="grid" id="host"></div></section>
  </div>
  <div><section><h2>Requests <span id="req-sum"></span></h2>
    <table><thead><tr><th>request</th><th>status</th><th class="n">seqs</th>
      <th class="n">device</th><th class="n">host</th></tr></thead>
      <tbody id="reqs"></tbody></table></section></div>
</main>
<div id="tip"></div>
<script>
"use strict";
const pools = {};
let holders = [], updates = 0;
// distinct request colours first (none near the swap orange or the pin yellow), then hues
const PALETTE = ["#4ea1ff", "#ff6fa8", "#5fd35f", "#a77bff", "#36c9c0", "#c3e05a", "#e05ad6",
  "#7fd4ff", "#ff9a9a", "#9af0c0", "#6f7dff", "#d6a2ff"];
const slots = new Map();  // request -> colour slot, kept while it is listed
let nextSlot = 0;
function colour(name) {
  if (name.startsWith("pin:")) return "hsl(48 90% 60%)";
  if (name.startsWith("seq:")) return "hsl(0 0% 62%)";
  if (!slots.has(name)) slots.set(name, nextSlot++);
  const k = slots.get(name);
  if (k < PALETTE.length) return PALETTE[k];
  let h = (k * 137.508 + 200) % 360;
  if (h > 12 && h < 56) h += 44;  // keep clear of the swap orange and the pin yellow
  return `hsl(${h} ${k % 2 ? 58 : 72}% ${k % 3 ? 60 : 52}%)`;
}
function shortId(id) { return id.length > 22 ? id.slice(0, 12) + "…" + id.slice(-6) : id; }
let focus = null;
function setFocus(name) {
  focus = name;
  for (const id of ["device", "host"]) {
    const p = pools[id], grid = document.getElementById(id);
    if (!p) continue;
    grid.classList.toggle("focus", name !== null);
    p.cells.forEach((d, b) => {
      const info = p.info.get(b);
      d.classList.toggle("hot", !!info && info.hs.some(h => holders[h] === name));
    });
  }
}
function cellSize(n) { return n <= 512 ? 16 : n <= 2048 ? 12 : n <= 8192 ? 8 : 5; }
function ensure(id, n) {
  let p = pools[id];
  if (p && p.cells.length === n) return p;
  const grid = document.getElementById(id);
  grid.textContent = "";
  grid.style.setProperty("--cell", cellSize(n) + "px");
  const cells = [];
  const frag = document.createDocumentFragment();
  for (let i = 0; i < n; i++) {
    const d = document.createElement("div");
    d.className = "blk free"; d.dataset.block = i; d.dataset.state = "free";
    frag.appendChild(d); cells.push(d);
  }
  grid.appendChild(frag);
  p = pools[id] = { cells, keys: new Array(n).fill("f"), info: new Map() };
  if (n === 0) grid.innerHTML = '<div class="empty">none</div>';
  return p;
}
const NAMES = { c: "cached", u: "used", s: "swapping" };
function draw(id, data, blockSize) {
  const p = ensure(id, data.num_blocks);
  const seen = new Set();
  p.info = new Map();
  for (const [b, s, refs, filled, hs] of data.blocks) {
    seen.add(b);
    const owner = hs.length ? holders[hs[0]] : "";
    const key = `${s}|${refs > 1}|${owner}|${filled}`;
    p.info.set(b, { s, refs, filled, hs });
    if (p.keys[b] === key) continue;
    p.keys[b] = key;
    const d = p.cells[b];
    d.className = "blk " + NAMES[s] + (refs > 1 ? " shared" : "") +
      (focus !== null && hs.some(h => holders[h] === focus) ? " hot" : "");
    d.dataset.state = NAMES[s];
    if (s === "u") {
      d.style.setProperty("--c", owner ? colour(owner) : "#8fbf5a");
      d.style.setProperty("--f", Math.round(100 * filled / blockSize) + "%");
    } else { d.style.removeProperty("--c"); d.style.removeProperty("--f"); }
  }
  for (let b = 0; b < p.cells.length; b++) {
    if (p.keys[b] !== "f" && !seen.has(b)) {
      p.keys[b] = "f"; const d = p.cells[b];
      d.className = "blk free"; d.dataset.state = "free";
      d.style.removeProperty("--c"); d.style.removeProperty("--f");
    }
  }
  const c = data.counts, n = Math.max(1, data.num_blocks);
  document.getElementById(id + "-bar").innerHTML =
    [["used", "#8fbf5a"], ["swapping", "var(--swap)"], ["cached", "#3a587f"]].map(([k, col]) =>
      `<i style="width:${100 * c[k] / n}%;background:${col}"></i>`).join("");
  document.getElementById(id === "device" ? "dev-sum" : "host-sum").textContent =
    `${data.num_blocks} · used ${c.used} · cached ${c.cached} · swapping ${c.swapping}` +
    ` · free ${c.free}`;
}
function stat(label, value) { return `<span>${label} <b>${value}</b></span>`; }
function render(m) {
  holders = m.holders;
  draw("device", m.device, m.block_size);
  draw("host", m.host, m.block_size);
  const s = m.stats;
  document.getElementById("stats").innerHTML = [
    stat("running", s.running), stat("waiting", s.waiting), stat("swapped", s.swapped),
    stat("preemptions", s.preemptions), stat("swaps out/in", `${s.swap_outs}/${s.swap_ins}`),
    stat("prefix hit", (100 * s.prefix_hit_rate).toFixed(1) + "%"),
    stat("finished", s.finished), stat("aborted", s.aborted), stat("steps", s.steps),
  ].join("");
  document.getElementById("sub").textContent = `block size ${m.block_size} tokens`;
  const order = { running: 0, swapping_in: 1, swapping_out: 2, swapped: 3, waiting: 4 };
  const reqs = [...m.requests].sort((a, b) => (order[a.status] ?? 5) - (order[b.status] ?? 5));
  for (const name of [...slots.keys()]) {
    if (!m.requests.some(r => r.id === name)) slots.delete(name);
  }
  const rows = reqs.map(r => `<tr data-id="${esc(r.id)}"><td class="id" title="${esc(r.id)}">` +
    `<span class="sw" style="background:${colour(r.id)}"></span>${esc(shortId(r.id))}</td>` +
    `<td><span class="st ${r.status}">${r.status}</span></td><td class="n">${r.num_seqs}</td>` +
    `<td class="n">` +
    `${r.num_device_blocks}</td><td class="n">${r.num_host_blocks}</td></tr>`);
  document.getElementById("reqs").innerHTML = rows.length ? rows.join("") :
    '<tr><td colspan="5" class="empty">no requests</td></tr>';
  document.getElementById("req-sum").textContent = String(m.requests.length);
  document.body.dataset.updates = String(++updates);
}
function esc(t) {
  return String(t).replace(/[&<>"]/g, ch => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"})[ch]);
}
async function poll() {
  try {
    const r = await fetch("blocks.json", { cache: "no-store" });
    if (!r.ok) throw new Error(r.status);
    render(await r.json());
    document.getElementById("live").className = "";
  } catch (e) {
    document.getElementById("live").className = "stale";
    document.getElementById("sub").textContent = "disconnected: " + e;
  }
  setTimeout(poll, document.hidden ? 2000 : 250);
}
const tip = document.getElementById("tip");
const table = document.getElementById("reqs");
table.addEventListener("mouseover", ev => {
  const row = ev.target.closest("tr[data-id]");
  setFocus(row ? row.dataset.id : null);
});
table.addEventListener("mouseleave", () => setFocus(null));
document.addEventListener("mousemove", ev => {
  const d = ev.target.closest && ev.target.closest(".blk");
  if (!d) { tip.style.display = "none"; return; }
  const id = d.parentElement.id, b = Number(d.dataset.block);
  const info = pools[id] && pools[id].info.get(b);
  let text = `${id} block ${b}: ${d.dataset.state}`;
  if (info) {
    text += `\\nholders ${info.refs} · filled ${info.filled}`;
    for (const h of info.hs) text += "\\n  " + holders[h];
  }
  tip.textContent = text; tip.style.display = "block";
  tip.style.left = (ev.clientX + 14) + "px"; tip.style.top = (ev.clientY + 14) + "px";
});
poll();
</script>
</body></html>
"""
