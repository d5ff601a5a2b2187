// The live job page: a server-sent event feed replaces the status part, appends
// log lines (as text, never as HTML) and adds points to the curves (a small SVG
// plot drawn here; no library, nothing from a CDN).
"use strict";

// The job list: its rows are fetched again every LIST_EVERY seconds (rendered and
// escaped by the server's template) and swapped in when they changed; no reload.
(function () {
  const table = document.getElementById("jobs");
  if (!table) return;
  const rows = document.getElementById("job-rows");
  const live = document.getElementById("live");
  const EVERY = 1000 * Number(table.dataset.every || 2);
  const url = "/api/jobs.html?token=" + encodeURIComponent(table.dataset.token);
  let last = null, busy = false;
  function look() {
    if (busy || document.hidden) return;
    busy = true;
    fetch(url, {cache: "no-store"}).then(function (response) {
      if (!response.ok) throw new Error("HTTP " + response.status);
      return response.text();
    }).then(function (html) {
      if (html !== last) {
        rows.innerHTML = html;
        last = html;
        live.dataset.updates = String(Number(live.dataset.updates) + 1);
      }
      live.textContent = "live: updated " + new Date().toLocaleTimeString();
    }).catch(function () {
      live.textContent = "the logview server does not answer: retrying";
    }).finally(function () { busy = false; });
  }
  look();
  setInterval(look, EVERY);
})();

(function () {
  const root = document.getElementById("job");
  if (!root) return;
  const jobId = root.dataset.job;
  const token = root.dataset.token;
  const TAIL = 10 * 1024;
  const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  const SVG = "http://www.w3.org/2000/svg";
  const series = {};          // metric -> instance -> [[step, value], ...]
  const select = document.getElementById("metric");
  const plot = document.getElementById("plot");
  const legend = document.getElementById("legend");
  const live = document.getElementById("live");
  const logy = document.getElementById("logy");

  // -- log tails ---------------------------------------------------------------
  function tabFor(instance) {
    let tail = document.querySelector('#tails .tail[data-instance="' + CSS.escape(instance) + '"]');
    if (tail) return tail;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "tab";
    button.dataset.instance = instance;
    button.textContent = instance;
    document.getElementById("tabs").appendChild(button);
    tail = document.createElement("div");
    tail.className = "tail";
    tail.dataset.instance = instance;
    const pre = document.createElement("pre");
    pre.className = "log";
    tail.appendChild(pre);
    const link = document.createElement("a");
    link.className = "whole";
    tail.appendChild(link);
    document.getElementById("tails").appendChild(tail);
    if (!document.querySelector("#tabs .tab.on")) show(instance);
    return tail;
  }
  function show(instance) {
    document.querySelectorAll("#tabs .tab, #tails .tail").forEach(function (el) {
      el.classList.toggle("on", el.dataset.instance === instance);
    });
    const pre = document.querySelector("#tails .tail.on pre");
    if (pre) pre.scrollTop = pre.scrollHeight;   // a tail is read from its end
  }
  document.getElementById("tabs").addEventListener("click", function (ev) {
    if (ev.target.dataset && ev.target.dataset.instance) show(ev.target.dataset.instance);
  });
  function addLog(msg) {
    const tail = tabFor(msg.instance);
    const pre = tail.querySelector("pre");
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    let text = msg.reset ? msg.text : pre.textContent + msg.text;
    if (text.length > TAIL) {
      text = text.slice(text.length - TAIL);
      const nl = text.indexOf("\n");
      if (nl >= 0) text = text.slice(nl + 1);
    }
    pre.textContent = text;
    if (atBottom || msg.reset) pre.scrollTop = pre.scrollHeight;
    const link = tail.querySelector("a.whole");
    link.href = "/api/jobs/" + encodeURIComponent(jobId) + "/log?instance=" + encodeURIComponent(msg.instance) +
      "&attempt=" + msg.attempt + "&token=" + encodeURIComponent(token);
    link.textContent = "whole log of " + msg.instance + " (attempt " + msg.attempt + ")";
  }

  // -- curves --------------------------------------------------------------------
  function addPoints(points) {
    points.forEach(function (p) {
      const instance = p[0], key = p[1];
      (series[key] = series[key] || {});
      (series[key][instance] = series[key][instance] || []).push([p[2], p[3]]);
    });
    const keys = Object.keys(series).sort();
    if (keys.length !== select.options.length) {
      const current = select.value;
      select.textContent = "";
      keys.forEach(function (key) {
        const option = document.createElement("option");
        option.value = option.textContent = key;
        select.appendChild(option);
      });
      select.value = current && series[current] ? current : (series.loss ? "loss" : keys[0]);
    }
    if (!logyTouched) logy.checked = spansDecades(series[select.value] || {});
    draw();
  }
  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    plot.appendChild(node);
    return node;
  }
  function fmt(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    return String(Math.round(v * 1000) / 1000);
  }
  function draw() {
    const metric = select.value;
    const lines = series[metric] || {};
    const names = Object.keys(lines).sort();
    plot.textContent = "";
    legend.textContent = "";
    const W = 760, H = 320, L = 64, R = 16, T = 12, B = 34;
    const log = logy.checked;
    const ty = function (v) { return log ? Math.log10(Math.max(v, 1e-12)) : v; };
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity, count = 0;
    names.forEach(function (n) {
      lines[n].forEach(function (p) {
        x0 = Math.min(x0, p[0]); x1 = Math.max(x1, p[0]);
        y0 = Math.min(y0, ty(p[1])); y1 = Math.max(y1, ty(p[1]));
        count++;
      });
    });
    plot.dataset.points = String(count);
    plot.dataset.metric = metric || "";
    if (!count) { el("text", {x: W / 2, y: H / 2, "class": "empty"}, "no metrics yet"); return; }
    if (x1 === x0) { x1 = x0 + 1; }
    if (y1 === y0) { y1 = y0 + 1; y0 = y0 - 1; }
    const sx = function (x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
    const sy = function (y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
    el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, "class": "axis"});
    el("line", {x1: L, y1: T, x2: L, y2: H - B, "class": "axis"});
    for (let i = 0; i <= 4; i++) {
      const yv = y0 + (y1 - y0) * i / 4, xv = x0 + (x1 - x0) * i / 4;
      el("line", {x1: L, y1: sy(yv), x2: W - R, y2: sy(yv), "class": "grid"});
      el("text", {x: L - 6, y: sy(yv) + 4, "class": "tick", "text-anchor": "end"}, fmt(log ? Math.pow(10, yv) : yv));
      el("text", {x: sx(xv), y: H - B + 16, "class": "tick", "text-anchor": "middle"},
         fmt(x1 - x0 >= 8 ? Math.round(xv) : xv));
    }
    el("text", {x: W - R, y: H - 4, "class": "label", "text-anchor": "end"}, "step");
    names.forEach(function (n, i) {
      const colour = COLOURS[i % COLOURS.length];
      const pts = lines[n].slice().sort(function (a, b) { return a[0] - b[0]; });
      el("polyline", {points: pts.map(function (p) { return sx(p[0]).toFixed(1) + "," + sy(ty(p[1])).toFixed(1); }).join(" "),
                      stroke: colour, "class": "curve", "data-instance": n, "data-count": pts.length});
      const item = document.createElement("span");
      item.className = "key";
      const swatch = document.createElement("i");
      swatch.style.background = colour;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(n + " " + metric + " " + fmt(lines[n][lines[n].length - 1][1])));
      legend.appendChild(item);
    });
  }
  // A curve over several decades (a loss that converges) reads better on a log
  // scale: chosen until the user ticks or unticks the box.
  let logyTouched = false;
  function spansDecades(lines) {
    let lo = Infinity, hi = -Infinity;
    Object.keys(lines).forEach(function (n) {
      lines[n].forEach(function (p) { lo = Math.min(lo, p[1]); hi = Math.max(hi, p[1]); });
    });
    return lo > 0 && hi / lo >= 100;
  }
  select.addEventListener("change", function () {
    if (!logyTouched) logy.checked = spansDecades(series[select.value] || {});
    draw();
  });
  logy.addEventListener("change", function () { logyTouched = true; draw(); });
  document.querySelectorAll("#tails pre").forEach(function (pre) { pre.scrollTop = pre.scrollHeight; });

  // -- the feed --------------------------------------------------------------------
  let source = null;
  function connect() {
    source = new EventSource("/api/jobs/" + encodeURIComponent(jobId) + "/stream?token=" + encodeURIComponent(token));
    let first = true;
    source.addEventListener("status", function (ev) {
      // Rendered (and escaped) by the server's templates.
      const parts = JSON.parse(ev.data);
      document.getElementById("head").innerHTML = parts.head;
      document.getElementById("tail").innerHTML = parts.tail;
    });
    source.addEventListener("log", function (ev) { addLog(JSON.parse(ev.data)); });
    source.addEventListener("metrics", function (ev) {
      if (first) { Object.keys(series).forEach(function (k) { delete series[k]; }); first = false; }
      addPoints(JSON.parse(ev.data).points);
    });
    source.addEventListener("end", function (ev) {
      source.close();
      live.textContent = "the job is over: " + (JSON.parse(ev.data).verdict || JSON.parse(ev.data).status);
      live.dataset.state = "ended";
    });
    source.onopen = function () { first = true; live.textContent = "live"; live.dataset.state = "live"; };
    source.onerror = function () { if (live.dataset.state !== "ended") live.textContent = "reconnecting..."; };
  }
  connect();
})();
