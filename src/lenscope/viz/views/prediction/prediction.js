/* lenscope report: the model's prediction (top-k bars) and verify's verdict. */
(function () {
  "use strict";
  LS.sections.prediction = function (body, d, meta) {
    var v = d.verify, p = LS.el("p", null, null, body);
    LS.el("span", "badge " + (v.ok ? "ok" : "bad"), v.ok ? "verify: ok" : "verify: FAILED", p);
    LS.el("span", "meta", "  lenscope's recomputation of every sub-layer vs the real model: largest relative error " +
      LS.fmt(Math.max(v.max_rel_resid_error, v.max_rel_sublayer_error)) +
      (v.max_abs_logit_error === null ? "" : ", largest logit error " + LS.fmt(v.max_abs_logit_error)), p);
    if (!d.top.length) { LS.el("p", "note", "This model has no language-model head: no next-token prediction.", body); return; }
    var n = d.top.length, rowH = 22, left = 130, barW = 380, W = left + barW + 120, H = n * rowH + 24;
    var svg = LS.svg("svg", { width: W, height: H, "class": "topk" }, body);
    var pmax = d.top[0].prob;
    d.top.forEach(function (t, i) {
      var y = 6 + i * rowH, isT = meta.target_id === t.id, isF = meta.foil_id === t.id;
      LS.text(svg, left - 8, y + 14, LS.show(t.token, 16), { "text-anchor": "end", "font-size": 12.5, "class": "mono",
        "font-weight": isT ? 700 : 400, fill: isF ? "#a61e1e" : "#1d2230" });
      var bar = LS.svg("rect", { x: left, y: y + 2, width: Math.max(1.5, barW * t.prob / pmax), height: rowH - 6, rx: 3,
        fill: isT ? "#2f9e44" : isF ? "#e03131" : LS.colour("viridis", 0.25 + 0.6 * t.prob / pmax) }, svg);
      LS.text(svg, left + Math.max(1.5, barW * t.prob / pmax) + 6, y + 14, (t.prob * 100).toFixed(t.prob < 0.01 ? 2 : 1) + "%",
        { "font-size": 11.5, fill: "#374151" });
      LS.clickable(bar, "target", { token: t.token, id: t.id });
      LS.hover(bar, function (tp) {
        LS.line(tp, [["token ", 0], [JSON.stringify(t.token), 1], ["  #" + t.id, 0]]);
        LS.line(tp, [["probability ", 0], [(t.prob * 100).toFixed(3) + "%", 1], ["   logit ", 0], [LS.fmt(t.logit, 2), 1]]);
      });
    });
    LS.text(svg, left, H - 4, "entropy of the next-token distribution: " + LS.fmt(d.entropy, 2) + " nats",
      { "font-size": 11, fill: "#6b7280" });
  };
})();
