/* lenscope report: direct logit attribution by layer (attention vs MLP bars) and by head (heat map), for the
   target minus the foil, the target alone, or the foil alone (a switch). */
(function () {
  "use strict";
  function draw(body, d) {
    var what = "logit(" + JSON.stringify(d.label) + ")" + (d.minus !== null ? " \u2212 logit(" + JSON.stringify(d.minus) + ")" : "");
    var p = LS.el("p", "meta", null, body);
    LS.el("b", null, what + " = " + LS.fmt(d.logit, 3), p);
    LS.el("span", null, "   sum of the parts " + LS.fmt(d.total, 3) + " (completeness error " + LS.fmt(d.completeness_error) + ")" +
      d.other.map(function (o) { return "; " + o.name + " " + LS.fmt(o.value, 2); }).join(""), p);
    var L = d.attn.length, bw = Math.max(7, Math.min(16, Math.floor(760 / (2 * L)))), gap = 4;
    var left = 50, top = 14, h = 210, W = left + L * (2 * bw + gap) + 20, H = top + h + 40;
    var all = d.attn.concat(d.mlp);
    var lo = Math.min(0, Math.min.apply(null, all)), hi = Math.max(0, Math.max.apply(null, all));
    var span = (hi - lo) || 1, y = function (v) { return top + h * (hi - v) / span; };
    var row = LS.el("div", "row", null, body);
    var panel = LS.el("div", "panel", null, row);
    LS.el("h3", null, "By layer", panel);
    var lgd = LS.el("div", null, null, panel);
    [["attention", "var(--attn)"], ["MLP", "var(--mlp)"]].forEach(function (k) {
      var s = LS.el("span", "legend", null, lgd); var sw = LS.el("span", "sw", null, s); sw.style.background = k[1]; LS.el("span", null, k[0] + "  ", s);
    });
    var svg = LS.svg("svg", { width: W, height: H, "class": "dla-layers" }, panel);
    [lo, 0, hi].forEach(function (v) {
      LS.svg("line", { x1: left - 4, x2: W - 10, y1: y(v), y2: y(v), stroke: v === 0 ? "#9ca3af" : "#eef0f3" }, svg);
      LS.text(svg, left - 7, y(v) + 3.5, LS.fmt(v, 2), { "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
    });
    for (var l = 0; l < L; l++) {
      [["attention", d.attn[l], "#3b6fd4", 0], ["MLP", d.mlp[l], "#f08c2e", 1]].forEach(function (b) {
        var x = left + l * (2 * bw + gap) + b[3] * bw, v = b[1], layer = l;
        var r = LS.svg("rect", { x: x, y: Math.min(y(v), y(0)), width: bw - 1, height: Math.max(0.8, Math.abs(y(v) - y(0))),
          fill: b[2], rx: 1 }, svg);
        LS.hover(r, function (tp) { LS.line(tp, [["layer ", 0], [String(layer), 1], ["  " + b[0] + ": ", 0], [LS.fmt(v, 4), 1]]); });
      });
      if (l % (L > 20 ? 2 : 1) === 0)
        LS.text(svg, left + l * (2 * bw + gap) + bw, top + h + 14, String(l), { "text-anchor": "middle", "font-size": 10, fill: "#6b7280" });
    }
    LS.text(svg, left + (W - left) / 2, H - 6, "layer", { "text-anchor": "middle", "font-size": 11, fill: "#6b7280" });
    var nH = d.heads[0] ? d.heads[0].length : 0;
    if (!nH) return;
    var hp = LS.el("div", "panel", null, row);
    LS.el("h3", null, "By head", hp);
    var flat = []; d.heads.forEach(function (r) { flat = flat.concat(r); });
    var m = LS.maxAbs(flat);
    var hm = LS.heatmap(hp, { rows: L, cols: nH, cw: Math.max(14, Math.min(26, Math.floor(420 / nH))),
      ch: Math.max(9, Math.min(16, Math.floor(420 / L))), left: 34, bottom: 30,
      rowLabels: d.heads.map(function (_, l) { return L > 20 && l % 2 ? "" : String(l); }),
      colLabels: d.heads[0].map(function (_, k) { return "H" + k; }), cls: "dla-heads",
      tip: function (tp, r, c) { LS.line(tp, [["L" + r + ".H" + c + ": ", 0], [LS.fmt(d.heads[r][c], 4), 1]]); } });
    hm.draw(function (r, c) { return LS.div(d.heads[r][c], m); });
    hm.cells.forEach(function (cells, r) { cells.forEach(function (rect, c) { LS.clickable(rect, "head", { layer: r, head: c }); }); });
    LS.legendRamp(hp, "diverging", LS.fmt(-m, 2), LS.fmt(m, 2), 120);
  }
  LS.sections.components = function (body, d) {
    var keys = Object.keys(d.views), current = keys[0];
    var names = { difference: "target \u2212 foil", target: "target " + JSON.stringify(d.target), foil: "foil " + JSON.stringify(d.foil) };
    if (keys.length > 1) {
      var ctl = LS.el("div", "controls", null, body);
      LS.seg(ctl, "logit", keys.map(function (k) { return { value: k, label: names[k] }; }), current,
        function (k) { current = k; redraw(); });
    }
    var holder = LS.el("div", null, null, body);
    function redraw() { while (holder.firstChild) holder.removeChild(holder.firstChild); draw(holder, d.views[current]); }
    redraw();
  };
})();
