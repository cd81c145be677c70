/* lenscope report: context attribution of every method (tokens coloured by score, a method switch, all methods
   side by side) and the per-layer view of ALTI-Logit / Logit. */
(function () {
  "use strict";
  var NAMES = LS.methodNames;  // core.js
  LS.sections.attribution = function (body, d) {
    var methods = Object.keys(d.methods), current = methods[0], toks = d.tokens, n = toks.length;
    var ctl = LS.el("div", "controls", null, body);
    LS.seg(ctl, "method", methods.map(function (m) { return { value: m, label: NAMES[m] || m }; }), current,
      function (m) { current = m; drawStrip(); });
    var what = d.target === null ? "the last position's state" :
      JSON.stringify(d.target) + (d.foil !== null ? " rather than " + JSON.stringify(d.foil) : "");
    LS.el("span", "meta", "explaining " + what + "; red = pushes towards it, blue = against (each method on its own scale)", ctl);
    var strip = LS.el("div", "tokens", null, body);
    strip.setAttribute("data-role", "strip");
    var spans = toks.map(function (t, i) {
      var s = LS.el("span", "tok", LS.show(t), strip);
      if (i === n - 1) s.classList.add("pred");
      LS.clickable(s, "token", { position: i });
      LS.hover(s, function (tp) {
        LS.line(tp, [["position " + i + "  ", 0], [JSON.stringify(t), 1]]);
        methods.forEach(function (m) { LS.line(tp, [[(NAMES[m] || m) + ": ", 0], [LS.fmt(d.methods[m].scores[i], 4), m === current]]); });
      });
      return s;
    });
    function drawStrip() {
      var sc = d.methods[current].scores, m = LS.maxAbs(sc);
      spans.forEach(function (s, i) { var c = LS.div(sc[i], m); s.style.background = c; s.style.color = LS.ink(c); });
      var e = d.methods[current].invariant_error;
      info.textContent = (e === null || e === undefined) ? "" : "invariant error of this method: " + LS.fmt(e);
    }
    var info = LS.el("div", "meta", null, body);
    drawStrip();

    var row = LS.el("div", "row", null, body);
    var p1 = LS.el("div", "panel", null, row);
    LS.el("h3", null, "All methods side by side", p1);
    var hm = LS.heatmap(p1, { rows: methods.length, cols: n, cw: Math.max(16, Math.min(34, Math.floor(900 / n))), ch: 18, left: 130,
      bottom: 70, rowLabels: methods.map(function (m) { return NAMES[m] || m; }), colLabels: toks.map(function (t) { return LS.show(t, 12); }),
      cls: "attr-all", tip: function (tp, r, c) { LS.line(tp, [[(NAMES[methods[r]] || methods[r]) + " \u00b7 " + JSON.stringify(toks[c]) + ": ", 0],
        [LS.fmt(d.methods[methods[r]].scores[c], 4), 1]]); } });
    var scales = methods.map(function (m) { return LS.maxAbs(d.methods[m].scores); });
    hm.draw(function (r, c) { return LS.div(d.methods[methods[r]].scores[c], scales[r]); });
    hm.cells.forEach(function (cells) { cells.forEach(function (rect, c) { LS.clickable(rect, "token", { position: c }); }); });

    var per = Object.keys(d.layers);
    if (!per.length) return;
    var p2 = LS.el("div", "panel", null, row);
    LS.el("h3", null, "Per layer", p2);
    var which = per[0], ctl2 = LS.el("div", "controls", null, p2);
    if (per.length > 1) LS.seg(ctl2, "", per.map(function (m) { return { value: m, label: NAMES[m] || m }; }), which,
      function (m) { which = m; drawLayers(); });
    var M = {}; per.forEach(function (m) { M[m] = LS.matrix(d.layers[m]); });
    var L = M[which].length;
    var lh = LS.heatmap(p2, { rows: L, cols: n, cw: Math.max(14, Math.min(28, Math.floor(700 / n))), ch: Math.max(8, Math.min(15, Math.floor(450 / L))),
      left: 34, bottom: 70, rowLabels: M[which].map(function (_, l) { return L > 20 && (L - 1 - l) % 2 ? "" : String(L - 1 - l); }),
      colLabels: toks.map(function (t) { return LS.show(t, 12); }), cls: "attr-layers",
      tip: function (tp, r, c) { var l = L - 1 - r; LS.line(tp, [["layer " + l + " \u00b7 " + JSON.stringify(toks[c]) + ": ", 0], [LS.fmt(M[which][l][c], 4), 1]]); } });
    lh.cells.forEach(function (cells) { cells.forEach(function (rect, c) { LS.clickable(rect, "token", { position: c }); }); });
    var lg = LS.el("div", null, null, p2);
    function drawLayers() {
      var flat = []; M[which].forEach(function (r) { flat = flat.concat(r); });
      var m = LS.maxAbs(flat);
      lh.draw(function (r, c) { return LS.div(M[which][L - 1 - r][c], m); });
      while (lg.firstChild) lg.removeChild(lg.firstChild);
      LS.legendRamp(lg, "diverging", LS.fmt(-m, 2), LS.fmt(m, 2), 120);
    }
    drawLayers();
  };
})();
