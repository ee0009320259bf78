// dmtd live dashboard: plain JS + canvas, no external libraries. Polls /dashboard/stats.
"use strict";
const COLORS = ["#2f6fdb", "#e0692e", "#2a9d5b", "#b43ac8", "#c9a227", "#d43d51"];

function fmt(x, digits) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  return Number(x).toFixed(digits === undefined ? 1 : digits);
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function setup(canvas) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "11px system-ui, sans-serif";
  return ctx;
}

const TOP = 26;  // room for the legend above the plot

function axes(ctx, w, h, pad, ymax, unit) {
  ctx.strokeStyle = "#999"; ctx.fillStyle = "#555";
  ctx.beginPath(); ctx.moveTo(pad, TOP); ctx.lineTo(pad, h - pad); ctx.lineTo(w - 8, h - pad); ctx.stroke();
  ctx.fillText(fmt(ymax, ymax < 10 ? 2 : 0) + (unit || ""), 2, TOP + 4);
  ctx.fillText("0", pad - 10, h - pad);
}

// Grouped bars: groups = category labels, series = [{name, values}].
function bars(canvas, groups, series) {
  const ctx = setup(canvas), w = canvas.width, h = canvas.height, pad = 34;
  let ymax = 0;
  for (const s of series) for (const v of s.values) ymax = Math.max(ymax, v);
  canvas.dataset.points = String(series.reduce((n, s) => n + s.values.filter(v => v > 0).length, 0));
  canvas.dataset.groups = String(groups.length);
  axes(ctx, w, h, pad, ymax || 1);
  if (!groups.length || !ymax) return;
  const gw = (w - pad - 16) / groups.length;
  const bw = Math.min(56, Math.max(2, (gw - 12) / Math.max(1, series.length)));
  groups.forEach((g, i) => {
    const x0 = pad + 4 + i * gw + (gw - bw * series.length) / 2;
    series.forEach((s, j) => {
      const v = s.values[i] || 0, bh = (h - pad - TOP) * v / ymax;
      ctx.fillStyle = COLORS[j % COLORS.length];
      ctx.fillRect(x0 + j * bw, h - pad - bh, bw - 1, bh);
      ctx.fillStyle = "#333";
      if (v > 0) ctx.fillText(fmt(v, v < 10 ? 1 : 0), x0 + j * bw, h - pad - bh - 3);
    });
    ctx.fillStyle = "#333";
    ctx.fillText(g, pad + 4 + i * gw + gw / 2 - 10, h - pad + 14);
  });
  legend(ctx, series.map(s => s.name), w);
}

function lines(canvas, xs, series, unit) {
  const ctx = setup(canvas), w = canvas.width, h = canvas.height, pad = 34;
  let ymax = 0;
  for (const s of series) for (const v of s.values) ymax = Math.max(ymax, v || 0);
  canvas.dataset.points = String(series.reduce((n, s) => n + s.values.filter(v => v > 0).length, 0));
  axes(ctx, w, h, pad, ymax || 1, unit);
  if (xs.length < 1 || !ymax) return;
  const x0 = xs[0], x1 = xs[xs.length - 1], dx = Math.max(1e-9, x1 - x0);
  series.forEach((s, j) => {
    ctx.strokeStyle = COLORS[j % COLORS.length]; ctx.lineWidth = 2; ctx.beginPath();
    s.values.forEach((v, i) => {
      const x = pad + (w - pad - 12) * (xs.length > 1 ? (xs[i] - x0) / dx : 1);
      const y = h - pad - (h - pad - TOP) * (v || 0) / ymax;
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  });
  ctx.lineWidth = 1;
  legend(ctx, series.map(s => s.name), w);
}

function legend(ctx, names, w) {
  const pad0 = Math.max(40, w - 140 * names.length - 8);
  names.forEach((n, j) => {
    ctx.fillStyle = COLORS[j % COLORS.length];
    ctx.fillRect(pad0 + j * 140, 6, 10, 10);
    ctx.fillStyle = "#333";
    ctx.fillText(n, pad0 + 14 + j * 140, 15);
  });
}

function card(name, v, stats) {
  const c = el("div", {class: "card", "data-variant": name});
  c.appendChild(el("h2", {}, name));
  const rows = [
    ["$ / 1M output tokens", v.usd_per_million_tokens === null ? "–" : "$" + fmt(v.usd_per_million_tokens, 2), "usd"],
    ["output tokens/s", fmt(v.tokens_per_s, 1), "tok-s"],
    ["TTFT p50 / p95 ms", fmt(v.ttft_ms.p50, 0) + " / " + fmt(v.ttft_ms.p95, 0), "ttft"],
    ["ITL p50 / p95 ms", fmt(v.itl_ms.p50, 1) + " / " + fmt(v.itl_ms.p95, 1), "itl"],
    ["τ in force", String(v.tau), "tau"],
    ["SLO attainment", v.slo_attainment === null ? "–" : fmt(100 * v.slo_attainment, 0) + " %", "slo"],
    ["requests / tokens", v.requests + " / " + v.total_tokens, "totals"],
    ["exact: drafts accepted", v.exact ? v.exact.accepted + " / " + v.exact.drafted + " (" +
      fmt(100 * v.exact.acceptance, 0) + " %)" : "–", "exact-acceptance"],
    ["exact: accepted / cycle", v.exact ? fmt(v.exact.accepted_per_cycle, 2) : "–", "exact-per-cycle"],
    ["replica $/hour", "$" + fmt(v.usd_per_hour, 2), "usd-hour"],
  ];
  const t = el("table");
  for (const [label, value, key] of rows) {
    const tr = el("tr");
    tr.appendChild(el("td", {}, label));
    tr.appendChild(el("td", {class: "v", "data-key": key}, value));
    t.appendChild(tr);
  }
  c.appendChild(t);
  return c;
}

function render(stats) {
  const names = Object.keys(stats.variants);
  document.getElementById("meta").textContent =
    `deployment ${stats.deployment} · ${stats.replica_type} at $${fmt(stats.usd_per_replica_hour, 2)}/replica-hour · ` +
    `SLO TTFT ${fmt(stats.slo.ttft_ms, 0)} ms, ITL ${fmt(stats.slo.itl_ms, 0)} ms · in flight ${stats.inflight} · ` +
    `window ${fmt(stats.window_s, 0)} s`;
  const box = document.getElementById("variants");
  box.replaceChildren(...names.map(n => card(n, stats.variants[n], stats)));
  const series = stats.series || [];
  lines(document.getElementById("chart-throughput"), series.map(p => p.t),
        names.map(n => ({name: n, values: series.map(p => p[n] || 0)})), "");
  const ks = [...new Set(names.flatMap(n => Object.keys(stats.variants[n].k_hist)))].sort((a, b) => a - b);
  bars(document.getElementById("chart-k"), ks.map(k => "k=" + k),
       names.map(n => ({name: n, values: ks.map(k => stats.variants[n].k_hist[k] || 0)})));
  const taus = [...new Set(names.flatMap(n => Object.keys(stats.variants[n].tau_hist)))].sort((a, b) => a - b);
  bars(document.getElementById("chart-tau"), taus.map(t => "τ=" + t),
       names.map(n => ({name: n, values: taus.map(t => stats.variants[n].tau_hist[t] || 0)})));
  const exact = names.filter(n => stats.variants[n].exact);
  const positions = [...new Set(exact.flatMap(n => stats.variants[n].exact.by_position.map(p => p.position)))]
    .sort((a, b) => a - b);
  bars(document.getElementById("chart-acceptance"), positions.map(p => "tail " + p),
       exact.map(n => {
         const byPos = Object.fromEntries(stats.variants[n].exact.by_position.map(p => [p.position, p.acceptance]));
         return {name: n, values: positions.map(p => byPos[p] || 0)};
       }));
  bars(document.getElementById("chart-latency"), ["TTFT p50", "TTFT p95", "ITL p50", "ITL p95"],
       names.map(n => {
         const v = stats.variants[n];
         return {name: n, values: [v.ttft_ms.p50, v.ttft_ms.p95, v.itl_ms.p50, v.itl_ms.p95]};
       }));
  document.body.dataset.updated = String(Date.now());
}

async function poll() {
  try {
    const r = await fetch("/dashboard/stats", {cache: "no-store"});
    if (r.ok) render(await r.json());
    else document.getElementById("meta").textContent = "stats unavailable (HTTP " + r.status + ")";
  } catch (e) {
    document.getElementById("meta").textContent = "gateway unreachable; retrying";
  }
  setTimeout(poll, 1000);
}

poll();
