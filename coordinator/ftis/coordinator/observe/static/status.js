// FTIS coordinator status page: draws the charts of the server-rendered page with uPlot
// (vendored under static/uplot) and reloads the page's contents in place. No build step.
(function () {
  "use strict";
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                 "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939"];
  var plots = [];
  var refreshes = 0;

  function readData() {
    var el = document.getElementById("status-data");
    return el ? JSON.parse(el.textContent) : { charts: [], refresh_s: 10 };
  }

  function countPoints(chart) {
    var n = 0;
    chart.series.forEach(function (s) {
      s.values.forEach(function (v) { if (v !== null && v !== undefined) n++; });
    });
    return n;
  }

  function draw(chart, box) {
    var section = box.closest(".chart");
    var points = countPoints(chart);
    section.setAttribute("data-series", String(chart.series.length));
    section.setAttribute("data-points", String(points));
    section.classList.toggle("empty", points === 0);
    if (points === 0) return null;
    var bars = chart.kind === "bars";
    var series = [{}];
    chart.series.forEach(function (s, i) {
      var threshold = /threshold/.test(s.label);
      series.push({
        label: s.label,
        stroke: threshold ? "#999" : PALETTE[i % PALETTE.length],
        dash: threshold ? [6, 4] : undefined,
        width: bars ? 1 : 1.5,
        fill: bars ? "rgba(31,119,180,0.5)" : undefined,
        spanGaps: true,
        points: { show: !bars, size: 3 },
        paths: bars ? uPlot.paths.bars({ size: [0.8, 60] }) : undefined,
      });
    });
    var opts = {
      width: Math.max(300, box.clientWidth || section.clientWidth - 20),
      height: 220,
      series: series,
      scales: { x: { time: chart.x_time } },
      axes: [
        bars ? { values: function (u, v) { return v.map(function (x) { return x.toFixed(2); }); } }
             : chart.x_time ? {} : { label: chart.x_label, labelSize: 18 },
        { label: chart.unit, size: 56 },
      ],
      legend: { live: false },
    };
    var data = [chart.x].concat(chart.series.map(function (s) { return s.values; }));
    var plot = new uPlot(opts, data, box);
    section.setAttribute("data-rendered", "1");
    return plot;
  }

  function drawAll() {
    plots.forEach(function (p) { if (p) p.destroy(); });
    plots = [];
    var data = readData();
    data.charts.forEach(function (chart) {
      var section = document.getElementById("chart-" + chart.id);
      if (!section) return;
      var box = section.querySelector(".plot");
      box.innerHTML = "";
      plots.push(draw(chart, box));
    });
    document.body.setAttribute("data-charts-drawn", String(data.charts.length));
    return data;
  }

  function refresh() {
    fetch(window.location.href, { cache: "no-store", credentials: "same-origin" })
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.text(); })
      .then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.getElementById("status");
        var main = document.getElementById("status");
        if (!fresh || !main) return;
        var y = window.scrollY;
        main.replaceWith(document.importNode(fresh, true));
        drawAll();
        window.scrollTo(0, y);
        refreshes += 1;
        document.body.setAttribute("data-refreshes", String(refreshes));
      })
      .catch(function () { /* keep the last page; try again at the next tick */ });
  }

  var data = drawAll();
  setInterval(refresh, Math.max(2, data.refresh_s || 10) * 1000);
  var resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(drawAll, 200);
  });
})();
