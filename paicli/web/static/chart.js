// The one line chart of the logview pages (the job page's metrics, the study page's
// trials): a small SVG plot with axes, a grid of five ticks, a polyline and a legend
// entry per curve. Text goes in as text, never as HTML; no library, nothing from a CDN.
"use strict";

window.paiChart = (function () {
  const SVG = "http://www.w3.org/2000/svg";
  const W = 760, H = 320, L = 64, R = 16, T = 12, B = 34;

  function fmt(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    return String(Math.round(v * 1000) / 1000);
  }

  // A curve over several decades (a loss that converges) reads better on a log
  // scale: the pages choose it until the user ticks or unticks the box.
  function spansDecades(pointLists) {
    let lo = Infinity, hi = -Infinity;
    pointLists.forEach(function (points) {
      points.forEach(function (p) { lo = Math.min(lo, p[1]); hi = Math.max(hi, p[1]); });
    });
    return lo > 0 && hi / lo >= 100;
  }

  // curves: [{points: [[x, value], ...], colour, label, className, attrs}], drawn
  // into the <svg> `plot` and the element `legend`; plot.dataset.points counts them.
  // `xLabel` names the x axis ("step" unless said).
  function draw(plot, legend, curves, log, xLabel) {
    plot.textContent = "";
    legend.textContent = "";
    function el(tag, attrs, text) {
      const node = document.createElementNS(SVG, tag);
      Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
      if (text !== undefined) node.textContent = text;
      plot.appendChild(node);
      return node;
    }
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
      el("text", {x: sx(xv), y: H - B + 16, "class": "tick", "text-anchor": "middle"},
         fmt(x1 - x0 >= 8 ? Math.round(xv) : xv));
    }
    el("text", {x: W - R, y: H - 4, "class": "label", "text-anchor": "end"}, xLabel || "step");
    curves.forEach(function (c) {
      // Points may arrive out of step order (several attempts, a restarted feed).
      const pts = c.points.slice().sort(function (a, b) { return a[0] - b[0]; });
      el("polyline", Object.assign({
        points: pts.map(function (p) { return sx(p[0]).toFixed(1) + "," + sy(ty(p[1])).toFixed(1); }).join(" "),
        stroke: c.colour, "class": c.className || "curve", "data-count": pts.length}, c.attrs || {}));
      const item = document.createElement("span");
      item.className = "key";
      const swatch = document.createElement("i");
      swatch.style.background = c.colour;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(c.label));
      legend.appendChild(item);
    });
  }

  return {draw: draw, fmt: fmt, spansDecades: spansDecades};
})();
