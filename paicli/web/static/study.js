// The study page of `pai tune`: every EVERY seconds, while the study runs, its
// status and trial table (rendered and escaped by the server) are fetched again and
// swapped in, and every trial's curve is drawn on one SVG chart (chart.js, shared
// with the job page).
"use strict";

(function () {
  const root = document.getElementById("study");
  if (!root) return;
  const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
                   "#7f7f7f", "#bcbd22"];
  const name = root.dataset.study, token = encodeURIComponent(root.dataset.token);
  const EVERY = 1000 * Number(root.dataset.every || 2);
  const base = "/api/studies/" + encodeURIComponent(name);
  const plot = document.getElementById("plot"), legend = document.getElementById("legend");
  const logy = document.getElementById("logy"), live = document.getElementById("live");
  const head = document.getElementById("study-head");
  let data = null, lastHead = null, logyTouched = false, timer = null;

  function draw() {
    const curves = data ? data.curves : [];
    plot.dataset.curves = String(curves.length);
    paiChart.draw(plot, legend, curves.map(function (c) {
      const best = c.trial === data.best;
      return {points: c.points, colour: COLOURS[c.trial % COLOURS.length],
              className: "curve" + (c.state === "Pruned" ? " pruned" : "") + (best ? " best" : ""),
              attrs: {"data-trial": c.trial},
              label: "trial " + c.trial + " " + c.state + (best ? " (best) " : " ") + data.metric + " " +
                     paiChart.fmt(c.points[c.points.length - 1][1])};
    }), logy.checked);
  }
  function look() {
    Promise.all([
      fetch(base + ".json?token=" + token, {cache: "no-store"}).then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); }),
      fetch(base + ".html?token=" + token, {cache: "no-store"}).then(function (r) { if (!r.ok) throw new Error(r.status); return r.text(); })
    ]).then(function (got) {
      data = got[0];
      if (got[1] !== lastHead) { head.innerHTML = got[1]; lastHead = got[1]; }
      if (!logyTouched) logy.checked = paiChart.spansDecades(data.curves.map(function (c) { return c.points; }));
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
