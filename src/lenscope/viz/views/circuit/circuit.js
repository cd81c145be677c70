/* lenscope report: the circuit of a clean/corrupted contrast (lenscope.circuits.circuit_json): the component graph
   (embed at the bottom, one row per layer with its heads then its MLP, logits at the top), a k slider over the
   faithfulness grid (the graph shows the top-k edges by |score| and the nodes they touch; for level "nodes" the
   top-k nodes), and the faithfulness curve (0 = corrupted run, 1 = clean run) with a marker at the slider's k. */
(function () {
  "use strict";
  var CAP = 300, GOAL = 0.8;
  var POS = "#c0281b", NEG = "#2b59c3";
  var DASH = { q: "", k: "6 3", v: "1.5 2.5" }, SHIFT = { q: -4, k: 0, v: 4 };

  function parse(name) { // "L3H1" -> {layer: 3, head: 1}; "L3.mlp" -> {layer: 3, mlp: true}; embed, logits
    var m = /^L(\d+)H(\d+)$/.exec(name);
    if (m) return { layer: +m[1], head: +m[2] };
    m = /^L(\d+)\.mlp$/.exec(name);
    if (m) return { layer: +m[1], mlp: true };
    if (name === "embed" || name === "logits") return { special: name };
    return null;
  }
  function receiver(dst) { // "L2H1.q" -> ["L2H1", "q"]; "L1.mlp" -> ["L1.mlp", ""]; "logits"
    var m = /^(L\d+H\d+)\.([qkv])$/.exec(dst);
    return m ? [m[1], m[2]] : [dst, ""];
  }
  function logGrid(n) { // about 24 log-spaced integers from 1 to n
    var out = [], steps = 24;
    for (var i = 0; i <= steps; i++) {
      var k = Math.round(Math.exp(Math.log(Math.max(1, n)) * i / steps));
      if (!out.length || k > out[out.length - 1]) out.push(k);
    }
    return out;
  }
  function pct(f) { return f >= 0.1 ? (100 * f).toFixed(0) + "%" : f >= 0.001 ? (100 * f).toFixed(2) + "%" : (100 * f).toExponential(1) + "%"; }

  LS.sections.circuit = function (body, d, meta) {
    var edgesLevel = d.level !== "nodes";
    var faith = (d.faithfulness || []).filter(function (f) { return f.value !== null && isFinite(f.value); }).sort(function (a, b) { return a.k - b.k; });
    var nodeScore = {};
    (d.nodes || []).forEach(function (n) { nodeScore[n.name] = n.score; });
    var edges = (d.edges || []).map(function (e) { var r = receiver(e.dst); return { src: e.src, dst: e.dst, to: r[0], ch: r[1], score: e.score }; });
    edges.sort(function (a, b) { return Math.abs(b.score) - Math.abs(a.score); });
    var ranked = (d.nodes || []).filter(function (n) { return n.name !== "logits"; }).slice()
      .sort(function (a, b) { return Math.abs(b.score) - Math.abs(a.score); });
    var items = edgesLevel ? edges : ranked, unit = edgesLevel ? "edges" : "nodes";
    var total = d.total || (faith.length && faith[faith.length - 1].fraction > 0 ?
      Math.round(faith[faith.length - 1].k / faith[faith.length - 1].fraction) : items.length);
    var ks = faith.length ? faith.map(function (f) { return f.k; }) : logGrid(items.length);
    var reach = null;
    faith.forEach(function (f) { if (reach === null && f.value >= GOAL) reach = f; });

    // the layout: every component the graph names, and the model's layer count
    var L = meta && meta.n_layers ? meta.n_layers : 0, H = 0, hasMlp = false;
    function see(name) {
      var p = parse(name);
      if (!p || p.special) return;
      L = Math.max(L, p.layer + 1);
      if (p.mlp) hasMlp = true; else H = Math.max(H, p.head + 1);
    }
    (d.nodes || []).forEach(function (n) { see(n.name); });
    edges.forEach(function (e) { see(e.src); see(e.to); });
    var cols = H + (hasMlp ? 1 : 0) || 1;

    // header: what ran
    var info = LS.el("p", "meta", null, body);
    LS.el("b", null, (d.method || "").toUpperCase() + " \u00b7 " + unit, info);
    LS.el("span", null, " \u00b7 " + d.n + " prompt pair" + (d.n === 1 ? "" : "s") + " \u00b7 metric clean " + LS.fmt(d.metric_clean, 3) +
      ", corrupted " + LS.fmt(d.metric_corrupted, 3) + " \u00b7 " + total + " " + unit + " in all" +
      (d.seconds_total !== undefined || d.seconds !== undefined ? " \u00b7 " +
        LS.fmt(d.seconds_total !== undefined ? d.seconds_total : d.seconds, 1) + " s" : ""), info);
    if (meta && meta.corrupted !== undefined && meta.corrupted !== null) {
      var cp = LS.el("p", "meta", null, body);
      LS.el("span", null, "corrupted prompt: ", cp);
      LS.el("code", "circuit-corrupted", meta.corrupted, cp);
    }

    var ctl = LS.el("div", "controls", null, body);
    var kIndex = 0;
    if (reach) kIndex = ks.indexOf(reach.k);
    else { for (var i = 0; i < ks.length; i++) if (ks[i] <= Math.min(CAP, 50)) kIndex = i; }
    var slider = LS.slider(ctl, "circuit size k", 0, ks.length - 1, 1, kIndex, function (v) { kIndex = v; draw(); },
      function (v) { return "k = " + ks[v]; });
    slider.setAttribute("data-role", "k");
    var readout = LS.el("span", "circuit-readout", null, ctl);
    readout.setAttribute("data-role", "value");
    var summary = LS.el("div", "meta", null, body);
    summary.textContent = faith.length ? (reach ? "smallest circuit reaching " + GOAL + " of the clean run: k = " + reach.k +
      " " + unit + " (" + pct(reach.fraction) + ")" : "no circuit on the grid reaches " + GOAL + " of the clean run") :
      "no faithfulness curve was computed";
    summary.setAttribute("data-role", "reach");
    if (d.check) {
      var ck = LS.el("div", "meta", null, body);
      ck.setAttribute("data-role", "check");
      ck.textContent = "against exact patching: Spearman " + LS.fmt(d.check.spearman, 3) + " \u00b7 top-10 recall " +
        LS.fmt(d.check.top10_recall, 2) + (d.check.false_negatives && d.check.false_negatives.length ?
          " \u00b7 missed (false negatives): " + d.check.false_negatives.join(", ") : " \u00b7 no false negatives");
    }

    var row = LS.el("div", "row", null, body);
    var gp = LS.el("div", "panel", null, row);
    LS.el("h3", null, "Circuit graph", gp);
    var lgd = LS.el("div", "circuit-legend", null, gp);
    [["score > 0", POS], ["score < 0", NEG]].forEach(function (k) {
      var s = LS.el("span", "legend", null, lgd); var sw = LS.el("span", "sw", null, s); sw.style.background = k[1]; LS.el("span", null, k[0], s);
    });
    if (edgesLevel) ["q", "k", "v"].forEach(function (c) {
      var s = LS.el("span", "legend", null, lgd);
      var sv = LS.svg("svg", { width: 26, height: 10 }, s);
      LS.svg("line", { x1: 1, y1: 5, x2: 25, y2: 5, stroke: "#374151", "stroke-width": 1.6, "stroke-dasharray": DASH[c] }, sv);
      LS.el("span", null, "into a head's " + { q: "query", k: "key", v: "value" }[c], s);
    });

    var dx = Math.max(26, Math.min(70, Math.floor(900 / cols))), dy = Math.max(18, Math.min(56, Math.floor(640 / (L + 2))));
    var left = 44, top = 16, W = left + cols * dx + 16, Hh = top + (L + 1) * dy + 24;
    var svg = LS.svg("svg", { width: W, height: Hh, "class": "circuit-graph" }, gp);
    var gGrid = LS.svg("g", {}, svg), gEdges = LS.svg("g", {}, svg), gNodes = LS.svg("g", {}, svg);
    function Y(rowIx) { return top + (L + 1 - rowIx) * dy; } // row 0: embed, 1..L: layers, L+1: logits
    function where(name) {
      var p = parse(name);
      if (!p) return null;
      if (p.special === "embed") return [left + cols * dx / 2, Y(0)];
      if (p.special === "logits") return [left + cols * dx / 2, Y(L + 1)];
      return [left + (p.mlp ? H : p.head) * dx + dx / 2, Y(p.layer + 1)];
    }
    for (var l = 0; l <= L + 1; l++) {
      if (l > 0 && l <= L && L > 24 && (l - 1) % 2) continue;
      LS.text(gGrid, left - 8, Y(l) + 3.5, l === 0 ? "emb" : l === L + 1 ? "out" : "L" + (l - 1),
        { "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
      if (l > 0 && l <= L) LS.svg("line", { x1: left, x2: left + cols * dx, y1: Y(l), y2: Y(l), stroke: "#f1f3f5" }, gGrid);
    }
    // every component as a faint dot; those in the circuit drawn on top, larger
    var names = ["embed"];
    for (var la = 0; la < L; la++) {
      for (var h = 0; h < H; h++) names.push("L" + la + "H" + h);
      if (hasMlp) names.push("L" + la + ".mlp");
    }
    names.push("logits");
    var dots = {};
    names.forEach(function (nm) {
      var p = where(nm), special = nm === "embed" || nm === "logits";
      var c = special ? LS.svg("rect", { x: p[0] - 22, y: p[1] - 7, width: 44, height: 14, rx: 7, fill: "#e9ecef", stroke: "#adb5bd" }, gNodes)
        : LS.svg("circle", { cx: p[0], cy: p[1], r: 2.2, fill: "#dee2e6" }, gNodes);
      if (special) LS.text(gNodes, p[0], p[1] + 3.5, nm, { "text-anchor": "middle", "font-size": 9.5, fill: "#374151", "pointer-events": "none" });
      c.setAttribute("data-node", nm);
      LS.hover(c, function (tp) {
        LS.line(tp, [[nm, 1]]);
        if (nodeScore[nm] !== undefined) LS.line(tp, [["node score: ", 0], [LS.fmt(nodeScore[nm], 4), 1]]);
        var io = c.__io;
        if (io) LS.line(tp, [["in this circuit: " + io[0] + " edge" + (io[0] === 1 ? "" : "s") + " in, " + io[1] + " out", 0]]);
      });
      dots[nm] = c;
    });
    var maxAbs = LS.maxAbs(items.map(function (e) { return e.score; })) || 1;

    // the faithfulness curve
    var fp = LS.el("div", "panel", null, row);
    LS.el("h3", null, "Faithfulness", fp);
    var fw = 380, fh = 250, fl = 44, ft = 12, fr = 12, fb = 38;
    var fsvg = LS.svg("svg", { width: fl + fw + fr, height: ft + fh + fb, "class": "circuit-faith" }, fp);
    var marker = null, mline = null;
    if (faith.length) {
      var kmin = Math.max(1, faith[0].k), kmax = Math.max(kmin * 10, faith[faith.length - 1].k);
      var vals = faith.map(function (f) { return f.value; });
      var vlo = Math.min(0, Math.min.apply(null, vals)), vhi = Math.max(1, Math.max.apply(null, vals));
      var FX = function (k) { return fl + fw * (Math.log(Math.max(k, kmin)) - Math.log(kmin)) / (Math.log(kmax) - Math.log(kmin)); };
      var FY = function (v) { return ft + fh * (vhi - v) / ((vhi - vlo) || 1); };
      [vlo, 0, GOAL, 1, vhi].filter(function (v, ix, a) { return a.indexOf(v) === ix; }).forEach(function (v) {
        var goal = v === GOAL;
        LS.svg("line", { x1: fl, x2: fl + fw, y1: FY(v), y2: FY(v), stroke: goal ? "#2f9e44" : "#e9ecef",
          "stroke-dasharray": goal ? "5 3" : "", "class": goal ? "goal" : "" }, fsvg);
        LS.text(fsvg, fl - 5, FY(v) + 3.5, LS.fmt(v, 1), { "text-anchor": "end", "font-size": 10, fill: goal ? "#2f9e44" : "#6b7280" });
      });
      for (var e10 = Math.ceil(Math.log10(kmin)); Math.pow(10, e10) <= kmax; e10++) {
        var kx = FX(Math.pow(10, e10));
        LS.svg("line", { x1: kx, x2: kx, y1: ft, y2: ft + fh, stroke: "#f1f3f5" }, fsvg);
        LS.text(fsvg, kx, ft + fh + 13, e10 < 4 ? String(Math.pow(10, e10)) : "1e" + e10, { "text-anchor": "middle", "font-size": 10, fill: "#6b7280" });
      }
      LS.text(fsvg, fl + fw / 2, ft + fh + 30, "k (" + unit + " kept, log scale)", { "text-anchor": "middle", "font-size": 11, fill: "#6b7280" });
      LS.svg("polyline", { points: faith.map(function (f) { return FX(f.k).toFixed(1) + "," + FY(f.value).toFixed(1); }).join(" "),
        fill: "none", stroke: "#3b5bdb", "stroke-width": 1.8 }, fsvg);
      mline = LS.svg("line", { y1: ft, y2: ft + fh, stroke: "#9ca3af", "stroke-dasharray": "2 2" }, fsvg);
      faith.forEach(function (f, ix) {
        var pt = LS.svg("circle", { cx: FX(f.k), cy: FY(f.value), r: 3.2, fill: f.value >= GOAL ? "#2f9e44" : "#3b5bdb" }, fsvg);
        pt.style.cursor = "pointer";
        pt.addEventListener("click", function () { kIndex = ix; slider.value = ix; slider.dispatchEvent(new Event("input")); });
        LS.hover(pt, function (tp) {
          LS.line(tp, [["k = ", 0], [String(f.k), 1], [" " + unit + " (" + pct(f.fraction) + ")", 0]]);
          LS.line(tp, [["faithfulness ", 0], [LS.fmt(f.value, 3), 1]]);
        });
      });
      marker = LS.svg("circle", { r: 6, fill: "none", stroke: "#111827", "stroke-width": 2, "class": "marker" }, fsvg);
      fsvg.__fx = FX; fsvg.__fy = FY;
    } else {
      LS.text(fsvg, fl + fw / 2, ft + fh / 2, "no faithfulness curve", { "text-anchor": "middle", "font-size": 12, fill: "#6b7280" });
    }

    function edgePath(a, b) {
      if (Math.abs(a[1] - b[1]) < 1) { // same row (a head into its layer's MLP): an arc above the row
        var mx = (a[0] + b[0]) / 2, my = a[1] - 0.7 * dy;
        return "M" + a[0] + " " + a[1] + " Q" + mx + " " + my + " " + b[0] + " " + b[1];
      }
      var ym = (a[1] + b[1]) / 2;
      return "M" + a[0] + " " + a[1] + " C" + a[0] + " " + ym + " " + b[0] + " " + ym + " " + b[0] + " " + b[1];
    }
    function draw() {
      var k = ks[kIndex], shown = Math.min(k, CAP, items.length);
      while (gEdges.firstChild) gEdges.removeChild(gEdges.firstChild);
      var io = {}, lit = {};
      names.forEach(function (nm) { io[nm] = [0, 0]; });
      if (edgesLevel) {
        var best = edges.slice(0, shown);
        for (var j = best.length - 1; j >= 0; j--) (function (e, rank) { // weakest first, strongest on top
          var a = where(e.src), b = where(e.to);
          if (!a || !b) return;
          b = [b[0] + (SHIFT[e.ch] || 0), b[1]];
          var w = Math.abs(e.score) / maxAbs;
          var p = LS.svg("path", { d: edgePath(a, b), fill: "none", stroke: e.score >= 0 ? POS : NEG,
            "stroke-width": (0.6 + 4.4 * w).toFixed(2), "stroke-opacity": (0.35 + 0.55 * w).toFixed(2),
            "stroke-dasharray": DASH[e.ch] || "", "stroke-linecap": "round", "data-edge": e.src + "->" + e.dst }, gEdges);
          LS.hover(p, function (tp) {
            LS.line(tp, [[e.src, 1], [" \u2192 ", 0], [e.dst, 1]]);
            LS.line(tp, [["score ", 0], [LS.fmt(e.score, 4), 1], ["  rank " + (rank + 1), 0]]);
          });
          lit[e.src] = lit[e.to] = true;
          if (io[e.to]) io[e.to][0]++;
          if (io[e.src]) io[e.src][1]++;
        })(best[j], j);
      } else {
        items.slice(0, shown).forEach(function (n) { lit[n.name] = true; });
      }
      var nm0 = 0;
      names.forEach(function (nm) {
        var c = dots[nm], on = !!lit[nm], s = nodeScore[nm];
        c.__io = edgesLevel ? io[nm] : null;
        if (nm === "embed" || nm === "logits") { c.setAttribute("stroke", on ? "#111827" : "#adb5bd"); return; }
        c.setAttribute("r", on ? 5 : 2.2);
        c.setAttribute("fill", on ? (s !== undefined ? LS.div(s, nodeMax) : "#495057") : "#dee2e6");
        c.setAttribute("stroke", on ? "#111827" : "none");
        c.setAttribute("stroke-width", on ? 0.8 : 0);
        if (on) nm0++;
      });
      svg.setAttribute("data-edges", edgesLevel ? Math.min(shown, edges.length) : 0);
      svg.setAttribute("data-nodes", nm0);
      var f = faith[kIndex];
      readout.textContent = (f ? "faithfulness at k = " + k + " (" + pct(f.fraction) + "): " + LS.fmt(f.value, 3) : "k = " + k) +
        (k > CAP && items.length ? " \u00b7 drawing the top " + Math.min(CAP, items.length) + " " + unit : "");
      if (marker && f) {
        var x = fsvg.__fx(f.k), y = fsvg.__fy(f.value);
        marker.setAttribute("cx", x); marker.setAttribute("cy", y); marker.setAttribute("data-k", f.k);
        mline.setAttribute("x1", x); mline.setAttribute("x2", x);
      }
    }
    // heads and MLPs on one colour scale (embed and logits, drawn as boxes, sum over many edges)
    var nodeMax = LS.maxAbs((d.nodes || []).filter(function (n) { return n.name !== "logits" && n.name !== "embed"; })
      .map(function (n) { return n.score; })) || 1;
    draw();
  };
})();
