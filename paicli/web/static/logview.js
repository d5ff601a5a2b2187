// The live job page: a server-sent event feed replaces the status part, appends
// log lines (as text, never as HTML) and adds points to the curves (drawn by
// chart.js, which the study page shares; no library, nothing from a CDN).
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
  const series = {};          // metric -> instance -> [[step, value], ...]
  const axis = {};            // metric -> what its x is: "step", or "seconds" (since the job started)
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
      axis[key] = p[4] || "step";
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
  function draw() {
    const metric = select.value;
    const lines = series[metric] || {};
    plot.dataset.metric = metric || "";
    paiChart.draw(plot, legend, Object.keys(lines).sort().map(function (n, i) {
      const pts = lines[n];
      return {points: pts, colour: COLOURS[i % COLOURS.length], attrs: {"data-instance": n},
              label: n + " " + metric + " " + paiChart.fmt(pts[pts.length - 1][1])};
    }), logy.checked, axis[metric]);
  }
  // The log scale is chosen (chart.js) until the user ticks or unticks the box.
  let logyTouched = false;
  function spansDecades(lines) {
    return paiChart.spansDecades(Object.keys(lines).map(function (n) { return lines[n]; }));
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
