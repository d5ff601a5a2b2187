// The study page of `pai tune`: every EVERY seconds, while the study runs, its
// status and trial table (rendered and escaped by the server) are fetched again and
// swapped in, and every trial's curve is drawn on one SVG chart (text as text).
"use strict";

(function () {
  const root = document.getElementById("study");
  if (!root) return;
  const SVG = "http://www.w3.org/2000/svg";
  const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
                   "#7f7f7f", "#bcbd22"];
  const name = root.dataset.study, token = encodeURIComponent(root.dataset.token);
  const EVERY = 1000 * Number(root.dataset.every || 2);
  const base = "/api/studies/" + encodeURIComponent(name);
  const plot = document.getElementById("plot"), legend = document.getElementById("legend");
  const logy = document.getElementById("logy"), live = document.getElementById("live");
  const head = document.getElementById("study-head");
  let data = null, lastHead = null, logyTouched = false, timer = null;

  function el(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
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
  function spansDecades(curves) {
    let lo = Infinity, hi = -Infinity;
    curves.forEach(function (c) { c.points.forEach(function (p) { lo = Math.min(lo, p[1]); hi = Math.max(hi, p[1]); }); });
    return lo > 0 && hi / lo >= 100;
  }
  function draw() {
    plot.textContent = "";
    legend.textContent = "";
    const curves = data ? data.curves : [];
    const W = 760, H = 320, L = 64, R = 16, T = 12, B = 34, log = logy.checked;
    const ty = function (v) { return log ? Math.log10(Math.max(v, 1e-12)) : v; };
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity, count = 0;
    curves.forEach(function (c) {
      c.points.forEach(function (p) {
        x0 = Math.min(x0, p[0]); x1 = Math.max(x1, p[0]);
        y0 = Math.min(y0, ty(p[1])); y1 = Math.max(y1, ty(p[1]));
        count++;
      });
    });
    plot.dataset.points = String(count);
    plot.dataset.curves = String(curves.length);
    if (!count) { el("text", {x: W / 2, y: H / 2, "class": "empty"}, "no metrics yet"); return; }
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y1 = y0 + 1; y0 = y0 - 1; }
    const sx = function (x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
    const sy = function (y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
    el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, "class": "axis"});
    el("line", {x1: L, y1: T, x2: L, y2: H - B, "class": "axis"});
    for (let i = 0; i <= 4; i++) {
      const yv = y0 + (y1 - y0) * i / 4, xv = x0 + (x1 - x0) * i / 4;
      el("line", {x1: L, y1: sy(yv), x2: W - R, y2: sy(yv), "class": "grid"});
      el("text", {x: L - 6, y: sy(yv) + 4, "class": "tick", "text-anchor": "end"}, fmt(log ? Math.pow(10, yv) : yv));
      el("text", {x: sx(xv), y: H - B + 16, "class": "tick", "text-anchor": "middle"}, fmt(x1 - x0 >= 8 ? Math.round(xv) : xv));
    }
    el("text", {x: W - R, y: H - 4, "class": "label", "text-anchor": "end"}, "step");
    curves.forEach(function (c) {
      const colour = COLOURS[c.trial % COLOURS.length];
      const best = c.trial === data.best;
      el("polyline", {points: c.points.map(function (p) { return sx(p[0]).toFixed(1) + "," + sy(ty(p[1])).toFixed(1); }).join(" "),
                      stroke: colour, "class": "curve" + (c.state === "Pruned" ? " pruned" : "") + (best ? " best" : ""),
                      "data-trial": c.trial, "data-count": c.points.length});
      const item = document.createElement("span");
      item.className = "key";
      const swatch = document.createElement("i");
      swatch.style.background = colour;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode("trial " + c.trial + " " + c.state + (best ? " (best) " : " ") +
                                               data.metric + " " + fmt(c.points[c.points.length - 1][1])));
      legend.appendChild(item);
    });
  }
  function look() {
    Promise.all([
      fetch(base + ".json?token=" + token, {cache: "no-store"}).then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); }),
      fetch(base + ".html?token=" + token, {cache: "no-store"}).then(function (r) { if (!r.ok) throw new Error(r.status); return r.text(); })
    ]).then(function (got) {
      data = got[0];
      if (got[1] !== lastHead) { head.innerHTML = got[1]; lastHead = got[1]; }
      if (!logyTouched) logy.checked = spansDecades(data.curves);
      draw();
      live.dataset.updates = String(Number(live.dataset.updates) + 1);
      if (data.over) {
        live.textContent = "the study is over: " + data.status;
        live.dataset.state = "ended";
        clearInterval(timer);
      } else {
        live.textContent = "live: updated " + new Date().toLocaleTimeString();
      }
    }).catch(function () { live.textContent = "the logview server does not answer: retrying"; });
  }
  logy.addEventListener("change", function () { logyTouched = true; draw(); });
  look();
  timer = setInterval(look, EVERY);
})();
