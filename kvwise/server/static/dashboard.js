// kvwise dashboard: polls /dashboard/data and draws inline SVG charts. No dependencies: the
// server ships this file and nothing is fetched from anywhere else.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const W = 560, H = 230, M = { l: 66, r: 14, t: 10, b: 34 };
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  const TIER_COLORS = {
    "device pool": "#1f77b4", host: "#ff7f0e", disk: "#2ca02c", redis: "#d62728",
  };
  let intervalMs = 2000;

  function $(id) { return document.getElementById(id); }

  function el(name, attrs, parent, text) {
    const node = document.createElementNS(SVG, name);
    for (const k in attrs) node.setAttribute(k, attrs[k]);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  function tierColor(name, i) { return TIER_COLORS[name] || COLORS[(i + 3) % COLORS.length]; }

  // ---- number formats ----------------------------------------------------------------------

  function fmtInt(n) { return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"); }
  function fmtPct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(x < 0.1 && x > 0 ? 1 : 0) + "%"; }
  function fmtSec(s) {
    if (s === null || s === undefined) return "–";
    if (s === 0) return "0";
    if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
    if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 1 : 0) + " ms";
    return s.toFixed(s < 10 ? 2 : 1) + " s";
  }
  function fmtRate(x) {
    if (x === null || x === undefined) return "–";
    return x.toFixed(x < 10 ? 1 : 0);
  }
  function fmtBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(n < 10 ? 1 : 0) : String(n)) + " " + units[i];
  }
  function fmtTokens(n) {
    if (n >= 1e6) return (n / 1e6).toFixed(n % 1e6 ? 1 : 0) + "M";
    if (n >= 1e3) return (n / 1e3).toFixed(n % 1e3 ? 1 : 0) + "K";
    return String(n);
  }
  function fmtAgo(t) {
    const a = -t;
    if (a < 0.5) return "now";
    if (a < 90) return "-" + Math.round(a) + "s";
    return "-" + (a / 60).toFixed(a < 600 ? 1 : 0).replace(/\.0$/, "") + "m";
  }

  // ---- scales and ticks ----------------------------------------------------------------------

  function niceTicks(lo, hi, count, integer) {
    if (!(hi > lo)) hi = lo + 1;
    const raw = Math.max((hi - lo) / count, integer ? 1 : 0);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((f) => f * mag).find((s) => s >= raw) || 10 * mag;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  function niceMax(lo, hi, count, integer) {
    // the first tick at or above hi, so the top of the chart is a round number
    const ticks = niceTicks(lo, hi, count, integer);
    const step = ticks.length > 1 ? ticks[1] - ticks[0] : hi - lo;
    const last = ticks[ticks.length - 1];
    return last >= hi ? last : +(last + step).toPrecision(12);
  }

  function logTicks(lo, hi) {
    const out = [];
    const decades = Math.log10(hi / lo);
    const steps = decades <= 2 ? [1, 2, 5] : decades <= 4 ? [1, 3] : [1];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
      for (const f of steps) {
        const v = f * Math.pow(10, e);
        if (v >= lo * 0.999 && v <= hi * 1.001) out.push(v);
      }
    }
    return out.length >= 2 ? out : [lo, hi];
  }

  function scale(lo, hi, a, b, log) {
    if (log) {
      const l0 = Math.log(lo), l1 = Math.log(hi);
      return (v) => a + (b - a) * (Math.log(Math.max(v, lo)) - l0) / (l1 - l0 || 1);
    }
    return (v) => a + (b - a) * (v - lo) / (hi - lo || 1);
  }

  // ---- one chart -----------------------------------------------------------------------------
  // opts: { series: [{ name, color, x: [], y: [], dash, fill, width }], xLog, yLog, xFmt,
  //         yFmt, yMin, yMax, xMin, xMax, xLabel, yLabel, markers: [{ x, color, label }],
  //         legend: element id }

  function drawChart(svg, opts) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const pts = [];
    for (const s of opts.series) {
      for (let i = 0; i < s.x.length; i++) {
        if (s.y[i] !== null && s.y[i] !== undefined && isFinite(s.y[i])) pts.push([s.x[i], s.y[i]]);
      }
    }
    drawLegend(opts);
    if (!pts.length) {
      el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg, opts.empty || "no data yet");
      return;
    }
    let xMin = opts.xMin !== undefined ? opts.xMin : Math.min(...pts.map((p) => p[0]));
    let xMax = opts.xMax !== undefined ? opts.xMax : Math.max(...pts.map((p) => p[0]));
    let yMin = opts.yMin !== undefined ? opts.yMin : Math.min(...pts.map((p) => p[1]));
    let yMax = opts.yMax !== undefined ? opts.yMax : Math.max(...pts.map((p) => p[1]));
    if (opts.yLog) { yMin = Math.max(yMin, 1e-6); yMax = Math.max(yMax, yMin * 10); }
    if (xMax <= xMin) xMax = xMin + 1;
    if (yMax <= yMin) yMax = yMin + 1;
    if (!opts.yLog && opts.yMax === undefined) yMax = niceMax(yMin, yMax, 4, opts.integer);
    const sx = scale(xMin, xMax, M.l, W - M.r, opts.xLog);
    const sy = scale(yMin, yMax, H - M.b, M.t, opts.yLog);
    const xt = opts.xLog ? logTicks(xMin, xMax) : niceTicks(xMin, xMax, 6);
    const yt = opts.yLog ? logTicks(yMin, yMax) : niceTicks(yMin, yMax, 4, opts.integer);
    const grid = el("g", {}, svg);
    for (const v of yt) {
      const y = sy(v);
      el("line", { x1: M.l, x2: W - M.r, y1: y, y2: y, class: "grid" }, grid);
      el("text", { x: M.l - 6, y: y + 4, "text-anchor": "end" }, grid, (opts.yFmt || String)(v));
    }
    for (const v of xt) {
      const x = sx(v);
      el("line", { x1: x, x2: x, y1: H - M.b, y2: H - M.b + 4, class: "axis" }, grid);
      el("text", { x: x, y: H - M.b + 16, "text-anchor": "middle" }, grid, (opts.xFmt || String)(v));
    }
    el("line", { x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b, class: "axis" }, grid);
    el("line", { x1: M.l, x2: M.l, y1: M.t, y2: H - M.b, class: "axis" }, grid);
    if (opts.xLabel) el("text", { x: (M.l + W - M.r) / 2, y: H - 3, "text-anchor": "middle" }, grid, opts.xLabel);
    if (opts.yLabel) el("text", { x: 11, y: (M.t + H - M.b) / 2, "text-anchor": "middle", transform: `rotate(-90 11 ${(M.t + H - M.b) / 2})` }, grid, opts.yLabel);

    for (const s of opts.series) {
      // runs of consecutive defined points (a null breaks the line)
      const runs = [];
      let run = [];
      for (let i = 0; i < s.x.length; i++) {
        const y = s.y[i];
        if (y === null || y === undefined || !isFinite(y)) { if (run.length) runs.push(run); run = []; continue; }
        run.push([sx(s.x[i]), sy(Math.min(Math.max(y, yMin), yMax))]);
      }
      if (run.length) runs.push(run);
      for (const r of runs) {
        const line = r.map((p, i) => (i ? "L" : "M") + p[0].toFixed(1) + " " + p[1].toFixed(1)).join(" ");
        if (s.fill) {
          const base = sy(opts.yLog ? yMin : Math.max(0, yMin)).toFixed(1);
          const area = line + ` L${r[r.length - 1][0].toFixed(1)} ${base} L${r[0][0].toFixed(1)} ${base} Z`;
          el("path", { d: area, fill: s.color, "fill-opacity": s.fill, stroke: "none", class: "area" }, svg);
        }
        if (r.length === 1) {
          el("circle", { cx: r[0][0], cy: r[0][1], r: 2.5, fill: s.color, class: "point" }, svg);
        }
        el("path", {
          d: r.length === 1 ? line + " l0.01 0" : line, fill: "none", stroke: s.color,
          "stroke-width": s.width || 2, "stroke-dasharray": s.dash || "none",
          "stroke-linejoin": "round", "stroke-linecap": "round", class: "series",
          "data-series": s.name,
        }, svg);
      }
    }
    for (const m of opts.markers || []) {
      if (m.x < xMin || m.x > xMax) continue;
      const x = sx(m.x);
      el("line", { x1: x, x2: x, y1: M.t, y2: H - M.b, stroke: m.color, "stroke-dasharray": "4 3", class: "marker" }, svg);
      el("text", { x: x + 3, y: M.t + 10 + (m.row || 0) * 12, fill: m.color, style: `fill:${m.color}` }, svg, m.label);
    }
  }

  function drawLegend(opts) {
    const box = opts.legend && $(opts.legend);
    if (!box) return;
    box.textContent = "";
    for (const s of opts.series) {
      if (s.noLegend) continue;
      const span = document.createElement("span");
      span.style.setProperty("--c", s.color);
      span.textContent = s.name;
      box.appendChild(span);
    }
  }

  // ---- the panels ------------------------------------------------------------------------------

  function setTile(id, text) {
    const node = document.querySelector(`#tile-${id} .value`);
    if (node) node.textContent = text;
  }

  function render(d) {
    const now = d.now, s = d.series;
    $("model").textContent = d.model;
    const status = $("status");
    status.className = d.engine_up ? "up" : "down";
    $("status-text").textContent = (d.engine_up ? "engine up" : "engine down") + " · updated " + new Date(d.time * 1000).toLocaleTimeString();
    $("interval").textContent = String(d.interval_s);
    const windowText = `last ${Math.round(d.window_s)} s`;

    setTile("requests_finished", fmtInt(now.requests_finished));
    setTile("waiting", fmtInt(now.waiting));
    setTile("running", fmtInt(now.running));
    setTile("rejected_429", fmtInt(now.rejected_429));
    setTile("pool", `${fmtInt(now.blocks_used)} / ${fmtInt(now.blocks_total)}`);
    setTile("device_hit_rate", fmtPct(now.hit_rate["device pool"]));
    setTile("load_decisions", fmtInt(now.load_decisions));
    setTile("recompute_decisions", fmtInt(now.recompute_decisions));
    setTile("loaded_tokens", fmtInt(now.loaded_tokens));
    setTile("ttft", fmtSec(now.ttft_mean_s));
    setTile("ttft_p50", fmtSec(now.ttft_p50_s));
    setTile("ttft_p99", fmtSec(now.ttft_p99_s));
    setTile("tokens_per_s", fmtRate(now.tokens_per_s));

    const t = s.t || [];
    const timeAxis = { xFmt: fmtAgo, xMax: 0, xMin: Math.min(-60, t.length ? t[0] : -60) };

    drawChart($("chart-tokens"), Object.assign({
      legend: "legend-tokens", yMin: 0, yLabel: "tokens/s", empty: "no tokens generated yet",
      series: [
        { name: "per interval", color: "#1f77b4", x: t, y: s.tokens_per_s, fill: 0.25 },
        { name: windowText + " mean", color: "#6b7385", x: t, y: s.tokens_per_s_window, dash: "5 4", width: 1.5 },
      ],
    }, timeAxis));
    $("sub-tokens").textContent = `tokens sampled by the engine, every ${d.interval_s} s; ` +
      `${fmtInt(now.generated_tokens)} since start`;

    drawChart($("chart-ttft"), Object.assign({
      legend: "legend-ttft", yMin: 0, yFmt: fmtSec, yLabel: "TTFT",
      empty: "no request finished in the window yet",
      series: [
        { name: "p50", color: "#1f77b4", x: t, y: s.ttft_p50_s },
        { name: "p99", color: "#d62728", x: t, y: s.ttft_p99_s },
        { name: "mean", color: "#6b7385", x: t, y: s.ttft_mean_s, dash: "5 4", width: 1.5 },
      ],
    }, timeAxis));
    $("sub-ttft").textContent = `of the requests finished in the ${windowText}: ` +
      `p50 ${fmtSec(now.ttft_p50_s)}, p99 ${fmtSec(now.ttft_p99_s)}, mean ${fmtSec(now.ttft_mean_s)}`;

    drawChart($("chart-pool"), Object.assign({
      legend: "legend-pool", yMin: 0, yLabel: "blocks", integer: true,
      series: [
        { name: "used + cached (free, reusable)", color: "#aec7e8", x: t, y: t.map((_, i) => s.blocks_used[i] + s.blocks_cached[i]), fill: 0.35, width: 1.5 },
        { name: "used by requests", color: "#1f77b4", x: t, y: s.blocks_used, fill: 0.35 },
        { name: "total", color: "#6b7385", x: t, y: s.blocks_total, dash: "5 4", width: 1.5 },
      ],
    }, timeAxis));
    $("sub-pool").textContent = now.blocks_total ? `${fmtPct(now.blocks_used / now.blocks_total)} used, ${fmtPct(now.blocks_cached / now.blocks_total)} cached and free` : "";

    const hitNames = Object.keys(s.hit_rate || {});
    drawChart($("chart-hits"), Object.assign({
      legend: "legend-hits", yMin: 0, yMax: 1, yFmt: fmtPct, yLabel: "prompt tokens served",
      empty: "no prompts in the window yet",
      series: hitNames.map((name, i) => ({ name, color: tierColor(name, i), x: t, y: s.hit_rate[name] })),
    }, timeAxis));
    $("sub-hits").textContent = `share of prompt tokens looked up that each served, ${windowText}; since start: ` +
      Object.keys(now.hit_rate).map((k) => `${k} ${fmtPct(now.hit_rate[k])}`).join(", ");

    drawChart($("chart-decisions"), Object.assign({
      legend: "legend-decisions", yMin: 0, yLabel: "decisions (total)", integer: true,
      series: [
        { name: "load from a tier", color: "#2ca02c", x: t, y: s.load_decisions },
        { name: "recompute (all or part)", color: "#d62728", x: t, y: s.recompute_decisions },
      ],
    }, timeAxis));
    $("sub-decisions").textContent = `${fmtInt(now.loaded_tokens)} tokens loaded, ${fmtInt(now.recomputed_tokens)} stored tokens recomputed instead, ${fmtInt(now.lookup_misses)} lookups no tier held`;

    drawChart($("chart-queue"), Object.assign({
      legend: "legend-queue", yMin: 0, yLabel: "requests", integer: true,
      series: [
        { name: "waiting", color: "#ff7f0e", x: t, y: s.waiting },
        { name: "running", color: "#1f77b4", x: t, y: s.running },
        { name: "429s per interval", color: "#d62728", x: t, y: s.rejected_429, dash: "2 3" },
      ],
    }, timeAxis));
    $("sub-queue").textContent = `${fmtInt(now.rejected_429)} rejected with 429 since start, ${fmtInt(now.preemptions)} preemptions; ` +
      `tool calls: ${fmtInt(now.tool_pauses)} paused, ${fmtInt(now.tool_resumes)} resumed (tokens: ` +
      `${fmtInt(now.tool_resumed_device_tokens)} from the pool, ${fmtInt(now.tool_resumed_tier_tokens)} from the tiers, ` +
      `${fmtInt(now.tool_recomputed_tokens)} recomputed)`;

    renderCost(d.cost_model);
    renderTiers(d.tiers || [], d.cost_model);
    renderTenants(d.tenants || []);
    renderBill(d.bill || { tenants: [] });
  }

  function renderBill(bill) {
    const body = $("bill-body");
    body.textContent = "";
    if (!bill.tenants.length) {
      const cell = body.insertRow().insertCell();
      cell.colSpan = 8;
      cell.textContent = "nothing billed yet";
      return;
    }
    const money = (x) => x === undefined ? "–" : `${x.toFixed(4)} ${bill.currency}`;
    for (const t of bill.tenants) {
      const k = t.tokens;
      const cells = [
        t.tenant, fmtInt(k.input), fmtInt(k.cache_read), fmtInt(k.cache_write_5m),
        fmtInt(k.cache_write_1h), fmtInt(k.output), money(t.cost && t.cost.total), money(t.saved),
      ];
      const row = body.insertRow();
      row.dataset.tenant = t.tenant;
      for (const c of cells) row.insertCell().textContent = c;
    }
  }

  function renderTenants(tenants) {
    const body = $("tenants-body");
    body.textContent = "";
    if (!tenants.length) {
      const cell = body.insertRow().insertCell();
      cell.colSpan = 6;
      cell.textContent = "no request finished yet";
      return;
    }
    for (const t of tenants) {
      const row = body.insertRow();
      row.dataset.tenant = t.name;
      if (t.other) row.title = "tenants beyond the busiest ones shown, together";
      const cells = [
        t.name, fmtInt(t.requests), fmtInt(t.prompt_tokens), fmtInt(t.generated_tokens),
        fmtInt(t.cached_tokens), t.prompt_tokens ? fmtPct(t.cached_tokens / t.prompt_tokens) : "–",
      ];
      for (const c of cells) row.insertCell().textContent = c;
    }
  }

  function renderTiers(tiers, cm) {
    const body = $("tiers-body");
    body.textContent = "";
    const breakEven = {};
    for (const tier of (cm && cm.tiers) || []) breakEven[tier.name] = tier.break_even_tokens;
    if (!tiers.length) {
      const row = body.insertRow();
      const cell = row.insertCell();
      cell.colSpan = 10;
      cell.textContent = "no KV tiers below the device pool";
      renderTierAlert([]);
      return;
    }
    for (const t of tiers) {
      const be = breakEven[t.name];
      const errors = (t.read_errors || 0) + (t.write_errors || 0) + (t.lookup_errors || 0) +
        (t.delete_errors || 0);
      const health = t.breaker_open ? "breaker open" : t.degraded ? "degraded" : "ok";
      const cells = [
        t.name, fmtInt(t.entries), fmtBytes(t.bytes), fmtInt(t.hits), fmtInt(t.loaded_tokens),
        t.loads ? fmtSec(t.load_seconds / t.loads) : "–", fmtInt(t.faults), fmtInt(errors),
        health, be === null || be === undefined ? "never" : fmtTokens(be) + " tokens",
      ];
      const row = body.insertRow();
      row.id = `tier-${t.name}`;
      for (const c of cells) row.insertCell().textContent = c;
      const healthCell = row.cells[8];
      healthCell.className = health === "ok" ? "" : "degraded";
      healthCell.title = t.degraded || "no error in the last minute";
    }
    renderTierAlert(tiers.filter((t) => t.degraded));
  }

  // a degraded tier is said above the tiles, with why (its errors, its breaker): its loads are
  // recomputed and its writes dropped while it lasts, so the answers stay right but slower
  function renderTierAlert(degraded) {
    const alert = $("tier-alert");
    alert.textContent = degraded.map((t) => `KV tier ${t.name} degraded: ${t.degraded}`).join("\n");
    alert.style.display = degraded.length ? "block" : "none";
  }

  function renderCost(cm) {
    const svg = $("chart-cost");
    if (!cm) {
      drawChart(svg, { legend: "legend-cost", series: [], empty: "no KV tiers: nothing to load" });
      $("sub-cost").textContent = "";
      return;
    }
    const x = cm.prefix_tokens;
    const series = [{ name: "recompute", color: "#1d2330", x, y: cm.recompute_ttft_s, width: 2.5 }];
    const markers = [];
    cm.tiers.forEach((tier, i) => {
      const color = tierColor(tier.name, i + 1);
      series.push({ name: `load from ${tier.name}`, color, x, y: tier.ttft_s });
      if (tier.break_even_tokens !== null) {
        markers.push({ x: tier.break_even_tokens, color, label: `${tier.name} ≥ ${fmtTokens(tier.break_even_tokens)}`, row: markers.length });
      }
    });
    drawChart(svg, {
      legend: "legend-cost", series, markers, xLog: true, yLog: true,
      xFmt: fmtTokens, yFmt: fmtSec, xLabel: "prefix length (tokens)", yLabel: "predicted TTFT",
    });
    const parts = cm.tiers.map((tier) => tier.break_even_tokens === null
      ? `${tier.name}: recompute always wins`
      : `${tier.name}: load wins from ${fmtTokens(tier.break_even_tokens)} tokens`);
    $("sub-cost").textContent = `policy ${cm.policy}; break-even ${parts.join(", ")} · fitted on ${fmtInt(cm.step_observations)} steps, ` +
      cm.tiers.map((tier) => `${fmtInt(tier.observations)} ${tier.name} reads`).join(", ");
  }

  // ---- polling -------------------------------------------------------------------------------

  function banner(text) {
    const b = $("banner");
    b.textContent = text || "";
    b.style.display = text ? "block" : "none";
  }

  async function poll() {
    try {
      const r = await fetch("/dashboard/data", { cache: "no-store", credentials: "same-origin" });
      if (!r.ok) {
        let message = `HTTP ${r.status}`;
        try { message = (await r.json()).error.message; } catch (e) { /* not JSON */ }
        banner(message);
        $("status").className = "down";
        $("status-text").textContent = "no access";
      } else {
        const d = await r.json();
        intervalMs = Math.max(500, 1000 * (d.interval_s || 2));
        banner("");
        render(d);
        document.body.dataset.updates = String(1 + Number(document.body.dataset.updates || 0));
      }
    } catch (e) {
      banner("the server does not answer: " + e.message);
      $("status").className = "down";
      $("status-text").textContent = "disconnected";
    }
    setTimeout(poll, intervalMs);
  }

  document.addEventListener("DOMContentLoaded", poll);
})();
