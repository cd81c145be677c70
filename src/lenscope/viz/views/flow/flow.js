/* lenscope report: the information-flow graph from ALTI contributions (tokens across, layers up). */
(function () {
  "use strict";
  LS.sections.flow = function (body, d, meta) {
    var C = LS.unpack(d.contributions), L = C.shape[0], n = d.tokens.length, thr = 0.04, focus = [C.shape[0], d.tokens.length - 1];
    var ctl = LS.el("div", "controls", null, body);
    var slider = LS.slider(ctl, "show edges above", 0.01, 0.5, 0.01, thr, function (v) { thr = v; draw(); },
      function (v) { return v.toFixed(2); });
    slider.setAttribute("data-role", "threshold");
    LS.el("span", "meta", "highlighted: what the last position draws on (click any node to trace it instead; click it again to show all); grey: a token's own residual", ctl);
    var dx = Math.max(34, Math.min(64, Math.floor(1000 / n))), dy = Math.max(20, Math.min(34, Math.floor(700 / L)));
    var left = 56, top = 14, W = left + n * dx + 20, H = top + L * dy + 84;
    var svg = LS.svg("svg", { width: W, height: H, "class": "flow" }, body);
    var gEdges = LS.svg("g", {}, svg), gNodes = LS.svg("g", {}, svg);
    var X = function (i) { return left + i * dx + dx / 2; }, Y = function (l) { return top + (L - l) * dy; };
    for (var l = 0; l <= L; l++) if (L <= 24 || l % 2 === 0 || l === L)
      LS.text(svg, left - 10, Y(l) + 3.5, l === 0 ? "emb" : String(l), { "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
    d.tokens.forEach(function (t, i) {
      var x = X(i), y = Y(0) + 12;
      LS.clickable(LS.text(svg, x, y, LS.show(t, 12), { "text-anchor": "end", "font-size": 10.5, "class": "mono", fill: "#374151",
        transform: "rotate(-50 " + x + " " + y + ")" }), "token", { position: i });
    });
    var nodes = [];
    for (var l2 = 0; l2 <= L; l2++) {
      nodes.push([]);
      for (var i = 0; i < n; i++) (function (ll, ii) {
        var c = LS.svg("circle", { cx: X(ii), cy: Y(ll), r: 3.6, fill: "#adb5bd", stroke: "#fff", "stroke-width": 1 }, gNodes);
        c.style.cursor = "pointer";
        c.addEventListener("click", function () { focus = (focus && focus[0] === ll && focus[1] === ii) ? null : [ll, ii]; draw(); });
        LS.hover(c, function (tp) {
          LS.line(tp, [[ll === 0 ? "embedding" : "after layer " + (ll - 1), 1], ["  position " + ii + " ", 0], [JSON.stringify(d.tokens[ii]), 1]]);
          if (ll > 0) {
            var best = [];
            for (var j = 0; j <= ii || (j < n && !meta.causal); j++) best.push([C.get(ll - 1, ii, j), j]);
            best.sort(function (a, b) { return b[0] - a[0]; });
            best.slice(0, 4).forEach(function (b) { LS.line(tp, [[(b[0] * 100).toFixed(1) + "% from ", 0], [JSON.stringify(d.tokens[b[1]]), 1]]); });
          }
        });
        nodes[ll].push(c);
      })(l2, i);
    }
    function draw() {
      while (gEdges.firstChild) gEdges.removeChild(gEdges.firstChild);
      var live = null;
      if (focus) { // the nodes the focused one draws on through edges above the threshold
        live = {}; live[focus[0] + ":" + focus[1]] = true;
        for (var l = focus[0]; l > 0; l--) for (var i = 0; i < n; i++) if (live[l + ":" + i])
          for (var j = 0; j < n; j++) if (C.get(l - 1, i, j) >= thr) live[(l - 1) + ":" + j] = true;
      }
      var count = 0;
      for (var l1 = 0; l1 < L; l1++) for (var a = 0; a < n; a++) for (var b = 0; b < n; b++) {
        var w = C.get(l1, a, b);
        if (!(w >= thr)) continue;
        var on = !live || (live[(l1 + 1) + ":" + a] && live[l1 + ":" + b]), self = a === b;
        var col = !on ? "#e9ecef" : self ? "#ced4da" : LS.colour("magma", 0.72 - 0.5 * Math.min(1, w));
        LS.svg("line", { x1: X(b), y1: Y(l1), x2: X(a), y2: Y(l1 + 1), stroke: col,
          "stroke-width": (0.5 + (self ? 2.5 : 5) * w).toFixed(2),
          "stroke-opacity": on ? (0.4 + 0.55 * Math.min(1, w)).toFixed(2) : 0.5, "stroke-linecap": "round" }, gEdges);
        count++;
      }
      for (var l3 = 0; l3 <= L; l3++) for (var k = 0; k < n; k++) {
        var lit = live && live[l3 + ":" + k];
        nodes[l3][k].setAttribute("fill", lit ? "#c0281b" : "#adb5bd");
        nodes[l3][k].setAttribute("r", lit ? 4.6 : 3.6);
      }
      svg.setAttribute("data-edges", count);
    }
    draw();
  };
})();
