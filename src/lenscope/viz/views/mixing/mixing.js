/* lenscope report: norm-based context-mixing maps, one layer and scope at a time (slider and switch). */
(function () {
  "use strict";
  var NAMES = { attention: "attention weights", attn_2020: "\u2016\u03b1f(x)\u2016 (2020)", attn: "ATTN", atb: "ATB",
    atbln: "ATB+LN", atblnff: "ATB+LN+FF", atblnffres: "ATB+LN+FF+RES", atblnffres_nextln: "+next LN",
    atbff: "ATB+FF", atbffres: "ATB+FF+RES", atbffresln: "ATB+FF+RES+LN" };
  LS.sections.mixing = function (body, d) {
    var scopes = d.scopes, scope = scopes[Math.min(scopes.length - 1, 2)], layer = 0, rowNorm = false;
    var U = {}; scopes.forEach(function (s) { U[s] = LS.unpack(d.maps[s]); });
    var L = U[scope].shape[0], n = d.tokens.length;
    var ctl = LS.el("div", "controls", null, body);
    LS.seg(ctl, "scope", scopes.map(function (s) { return { value: s, label: NAMES[s] || s }; }), scope,
      function (s) { scope = s; draw(); });
    var ctl2 = LS.el("div", "controls", null, body);
    var slider = LS.slider(ctl2, "layer", 0, L - 1, 1, 0, function (v) { layer = v; draw(); }, function (v) { return v + " / " + (L - 1); });
    slider.setAttribute("data-role", "layer");
    var lab = LS.el("label", "ctl-label", null, ctl2), cb = LS.el("input", null, null, lab);
    cb.type = "checkbox"; LS.el("span", null, " each row on its own scale", lab);
    cb.addEventListener("change", function () { rowNorm = cb.checked; draw(); });
    var info = LS.el("span", "meta", null, ctl2);
    var labels = d.tokens.map(function (t) { return LS.show(t, 12); });
    var cw = Math.max(14, Math.min(26, Math.floor(640 / n)));
    var hm = LS.heatmap(body, { rows: n, cols: n, cw: cw, ch: cw, left: 90, bottom: 76, rowLabels: labels, colLabels: labels,
      cls: "mixing-map", tip: function (tp, r, c) {
        LS.line(tp, [["layer " + layer + " \u00b7 " + (NAMES[scope] || scope), 1]]);
        LS.line(tp, [["to " + r + " ", 0], [JSON.stringify(d.tokens[r]), 1], [" from " + c + " ", 0], [JSON.stringify(d.tokens[c]), 1]]);
        LS.line(tp, [["value ", 0], [LS.fmt(U[scope].get(layer, r, c), 4), 1]]);
      } });
    // a row is what position r's state draws on: clicking it explains the prediction at r
    hm.cells.forEach(function (cells, r) { cells.forEach(function (rect) { LS.clickable(rect, "token", { position: r }); }); });
    var lg = LS.el("div", null, null, body);
    function draw() {
      var u = U[scope], hi = 1e-12, rowHi = [];
      for (var r = 0; r < n; r++) {
        var m = 1e-12;
        for (var c = 0; c < n; c++) { var v = u.get(layer, r, c); if (v > m) m = v; }
        rowHi.push(m); if (m > hi) hi = m;
      }
      hm.draw(function (r, c) { var v = u.get(layer, r, c); return LS.colour("blues", v / (rowNorm ? rowHi[r] : hi)); });
      info.textContent = "completeness error " + LS.fmt(d.completeness_error[scope]);
      while (lg.firstChild) lg.removeChild(lg.firstChild);
      LS.legendRamp(lg, "blues", "0", rowNorm ? "row max" : LS.fmt(hi, 3), 120);
    }
    draw();
  };
})();
