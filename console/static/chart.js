// The overview's chart: polls the sampled series (JSON) and draws it as SVG
// polylines. No library, no build step.
(function () {
  "use strict";
  var box = document.getElementById("chart");
  if (!box) { return; }
  var url = box.getAttribute("data-series");
  var every = parseInt(box.getAttribute("data-every"), 10) || 5000;
  var NS = "http://www.w3.org/2000/svg";

  function draw(svg, label, points, keys) {
    while (svg.firstChild) { svg.removeChild(svg.firstChild); }
    var top = 0;
    points.forEach(function (p) { keys.forEach(function (k) { top = Math.max(top, p[k]); }); });
    label.textContent = points.length ? "max " + (Math.round(top * 10) / 10) : "";
    if (points.length < 2) { return; }
    var t0 = Date.parse(points[0].at), t1 = Date.parse(points[points.length - 1].at);
    var span = Math.max(t1 - t0, 1), h = 140, w = 600, scale = top > 0 ? (h - 8) / top : 0;
    keys.forEach(function (k) {
      var line = document.createElementNS(NS, "polyline");
      line.setAttribute("class", k.replace(/_per_s$/, "").replace("publish", "publish").replace("handoff", "handoff"));
      line.setAttribute("points", points.map(function (p) {
        var x = (Date.parse(p.at) - t0) / span * w;
        return x.toFixed(1) + "," + (h - 4 - p[k] * scale).toFixed(1);
      }).join(" "));
      svg.appendChild(line);
    });
  }

  function tick() {
    fetch(url, { credentials: "same-origin" }).then(function (r) { return r.json(); }).then(function (s) {
      var pts = s.points || [];
      draw(document.getElementById("rates"), document.getElementById("rates-max"), pts, ["publish_per_s", "handoff_per_s"]);
      draw(document.getElementById("backlog-chart"), document.getElementById("backlog-max"), pts, ["pending", "failed"]);
      box.setAttribute("data-points", String(pts.length));
    }).catch(function () { box.setAttribute("data-error", "1"); });
  }
  tick();
  setInterval(tick, every);
}());
