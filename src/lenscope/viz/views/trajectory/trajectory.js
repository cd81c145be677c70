/* lenscope report: prediction trajectories (logit lens, and the tuned lens when given) as heat maps. */
(function () {
  "use strict";
  var VALUES = {
    entropy: { key: "entropy", label: "entropy", ramp: "viridis", flip: true, unit: " nats" },
    kl: { key: "kl", label: "KL(final \u2016 lens)", ramp: "magma", flip: true, log: true, unit: " nats" },
    prob: { key: "top_prob", label: "top-1 probability", ramp: "viridis", flip: false, unit: "" }
  };
  LS.sections.trajectory = function (body, d) {
    var TR = d.trajectories, current = "entropy", maps = [];
    var ctl = LS.el("div", "controls", null, body);
    var legend;
    LS.seg(ctl, "colour by", [{ value: "entropy", label: "entropy" }, { value: "kl", label: "KL to output" },
      { value: "prob", label: "top-1 prob" }], current, function (v) { current = v; redraw(); });
    var lg = LS.el("span", null, null, ctl);
    var row = LS.el("div", "row", null, body);
    TR.forEach(function (t) {
      var panel = LS.el("div", "panel", null, row);
      LS.el("h3", null, t.lens + " lens", panel);
      var S = t.state_labels.length, P = t.tokens.length;
      var rowLabels = t.state_labels.slice().reverse().map(function (s, i) { return i === 0 ? "out " + s : s; });
      var hm = LS.heatmap(panel, { rows: S, cols: P, cw: 44, ch: 15, left: 44, bottom: 66, cellText: true, cellFont: 8.5,
        rowLabels: rowLabels, colLabels: t.tokens.map(function (s) { return LS.show(s, 12); }),
        tip: function (tp, r, c) {
          var s = S - 1 - r, v = VALUES[current];
          LS.line(tp, [["state ", 0], [t.state_labels[s], 1], ["  position ", 0], [String(c), 1], ["  ", 0], [JSON.stringify(t.tokens[c]), 1]]);
          t.topk_tokens[s][c].forEach(function (tok, k) {
            LS.line(tp, [[(t.topk_prob[s][c][k] * 100).toFixed(1) + "%  ", 0], [JSON.stringify(tok), k === 0]]);
          });
          LS.line(tp, [["entropy ", 0], [LS.fmt(t.entropy[s][c], 2), 1], ["  KL ", 0], [LS.fmt(t.kl[s][c], 2), 1]]);
        } });
      hm.svg.setAttribute("data-lens", t.lens);
      hm.cells.forEach(function (cells) { cells.forEach(function (rect, c) { LS.clickable(rect, "token", { position: c }); }); });
      maps.push({ t: t, hm: hm, S: S });
    });
    function range(v) {
      if (v === "prob") return 1;
      var hi = 1e-6;
      TR.forEach(function (t) { t[VALUES[v].key].forEach(function (r) { r.forEach(function (x) { if (x > hi) hi = x; }); }); });
      return hi;
    }
    function redraw() {
      var v = VALUES[current], hi = range(current);
      var norm = function (x) { var u = v.log ? Math.log1p(x) / Math.log1p(hi) : x / hi; return v.flip ? 1 - u : u; };
      maps.forEach(function (m) {
        var vals = m.t[v.key];
        m.hm.draw(function (r, c) { return LS.colour(v.ramp, norm(vals[m.S - 1 - r][c])); },
                  function (r, c) { return LS.show(m.t.top_tokens[m.S - 1 - r][c], 6); });
      });
      while (lg.firstChild) lg.removeChild(lg.firstChild);
      var lo = v.flip ? LS.fmt(hi, 1) + v.unit : "0", hiS = v.flip ? "0" : "1";
      legend = LS.legendRamp(lg, v.ramp, v.label + ": " + lo, hiS + (v.flip ? v.unit : ""));
    }
    redraw();
  };
})();
