// A run's curves: fetch them every data-poll-ms and draw one uPlot chart per
// metric (what the server's calls returned, then what the client logged).
(function () {
  "use strict";
  var box = document.getElementById("charts");
  if (!box) return;
  var url = box.getAttribute("data-curves");
  var pollMs = Math.max(2000, parseInt(box.getAttribute("data-poll-ms"), 10) || 2000);
  var charts = {};  // key -> {plot, el}
  var STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 100000];
  var colors = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];

  function width() {
    return Math.max(260, Math.min(box.clientWidth - 8, 560));
  }

  function slug(s) {
    return s.replace(/[^A-Za-z0-9_-]/g, "_");
  }

  function draw(source, name, points, i) {
    var key = source + ":" + name;
    var xs = points.map(function (p) { return p[0]; });
    var ys = points.map(function (p) { return p[1]; });
    var data = [xs, ys];
    var c = charts[key];
    if (c) {
      c.plot.setData(data);
      c.el.setAttribute("data-points", String(points.length));
      return;
    }
    var el = document.createElement("figure");
    el.className = "chart";
    el.id = "chart-" + source + "-" + slug(name);
    el.setAttribute("data-metric", name);
    el.setAttribute("data-source", source);
    el.setAttribute("data-points", String(points.length));
    var cap = document.createElement("figcaption");
    cap.textContent = name + (source === "logged" ? " (client)" : "");
    el.appendChild(cap);
    box.appendChild(el);
    var plot = new uPlot({
      width: width(),
      height: 200,
      legend: { show: false },
      scales: { x: { time: false } },
      axes: [{ label: "step", incrs: STEP_INCRS }, {}],
      series: [{}, { label: name, stroke: colors[i % colors.length], width: 2,
                     points: { show: true, size: 5 } }],
    }, data, el);
    charts[key] = { plot: plot, el: el };
  }

  // The loss first, then the client's own metrics, then the server's others.
  function order(curves) {
    var steps = curves.steps || {};
    var logged = curves.logged || {};
    var first = Object.keys(steps).filter(function (n) { return n.indexOf("loss") === 0; }).sort();
    var rest = Object.keys(steps).filter(function (n) { return n.indexOf("loss") !== 0; }).sort();
    return first.map(function (n) { return ["steps", n, steps[n]]; })
      .concat(Object.keys(logged).sort().map(function (n) { return ["logged", n, logged[n]]; }))
      .concat(rest.map(function (n) { return ["steps", n, steps[n]]; }));
  }

  function render(curves) {
    var any = false;
    order(curves).forEach(function (entry, i) {
      if (!entry[2].length) return;
      draw(entry[0], entry[1], entry[2], i);
      box.appendChild(charts[entry[0] + ":" + entry[1]].el);  // keeps the order as charts appear
      any = true;
    });
    var empty = document.getElementById("no-curves");
    if (empty) empty.hidden = any;
  }

  function poll() {
    fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (r) {
        if (r.status === 401) { window.location.reload(); throw new Error("signed out"); }
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      })
      .then(render)
      .catch(function () {})
      .then(function () { setTimeout(poll, pollMs); });
  }

  window.addEventListener("resize", function () {
    Object.keys(charts).forEach(function (k) {
      charts[k].plot.setSize({ width: width(), height: 200 });
    });
  });
  poll();
})();
