/* lenscope report: the features of a prompt (lenscope features --html, FeatureActivations, the report's --dict).
   The tokens, each coloured by the strongest active feature of the chosen dictionary; click (or hover) a token:
   its active features per dictionary with their activations, each with its label where d.labels has one (lenscope
   dict label cached it). A feature whose card is in the data opens it below
   (LS.featureCard, feature.js); else a click emits LS.emit("feature", {site, feature}) for the app. */
(function () {
  "use strict";
  LS.sections.features = function (body, d) {
    var toks = d.tokens, n = toks.length, sites = d.sites, cards = d.cards || {};
    var cur = 0, pos = n - 1;
    var ctl = LS.el("div", "controls", null, body);
    if (sites.length > 1) LS.seg(ctl, "colour by", sites.map(function (s, j) { return { value: j, label: s }; }), cur,
      function (j) { cur = Number(j); colour(); });
    LS.el("span", "meta", "darker = a stronger feature at that token; click a token for its active features" +
      (Object.keys(cards).length ? "; a feature in bold opens its card" : ""), ctl);
    var strip = LS.el("div", "tokens", null, body);
    strip.setAttribute("data-role", "feature-tokens");
    function strongest(j, i) { var a = d.active[j][i]; return a.length ? a[0][1] : 0; }
    var spans = toks.map(function (t, i) {
      var s = LS.el("span", "tok", LS.show(t), strip);
      s.classList.add("ls-click");
      s.addEventListener("click", function () { select(i); });
      LS.hover(s, function (tp) {
        LS.line(tp, [["position " + i + "  ", 0], [JSON.stringify(t), 1]]);
        sites.forEach(function (site, j) {
          var a = d.active[j][i];
          LS.line(tp, [[site + ": ", 0], [d.l0[j][i] + " active", 1],
            [a.length ? "  strongest #" + a[0][0] + " (" + LS.fmt(a[0][1], 3) + ")" : "", 0]]);
        });
      });
      return s;
    });
    function colour() {
      var m = 0; for (var i = 0; i < n; i++) m = Math.max(m, strongest(cur, i));
      spans.forEach(function (s, i) {
        var v = strongest(cur, i), c = v > 0 ? LS.colour("magma", 1 - 0.8 * (m > 0 ? v / m : 0)) : "rgb(255,255,255)";
        s.style.background = c; s.style.color = LS.ink(c);
      });
    }
    var detail = LS.el("div", "feature-list", null, body);
    detail.setAttribute("data-role", "feature-list");
    var holder = LS.el("div", "feature-card-holder", null, body);
    function open(site, f) {
      var key = site + "#" + f;
      while (holder.firstChild) holder.removeChild(holder.firstChild);
      if (cards[key]) { LS.el("h3", null, "Feature " + key, holder); LS.featureCard(holder, cards[key]); }
      else LS.emit("feature", { site: site, feature: f });
    }
    function select(i) {
      pos = i;
      spans.forEach(function (s, k) { s.classList.toggle("ls-sel", k === i); });
      while (detail.firstChild) detail.removeChild(detail.firstChild);
      LS.el("p", "meta", "position " + i + " " + JSON.stringify(toks[i]) + ": its active features", detail);
      var row = LS.el("div", "row", null, detail);
      sites.forEach(function (site, j) {
        var panel = LS.el("div", "panel", null, row), a = d.active[j][i];
        LS.el("h3", null, site + " \u00b7 " + d.l0[j][i] + " active of " + d.widths[j], panel);
        if (!a.length) { LS.el("p", "note", "none", panel); return; }
        var m = a[0][1] || 1, tb = LS.el("table", "kv feature-table", null, panel);
        a.forEach(function (x) {
          var tr = LS.el("tr", null, null, tb), key = site + "#" + x[0];
          var th = LS.el("th", null, null, tr), link = LS.el(cards[key] ? "b" : "span", "feature-link ls-click", "#" + x[0], th);
          link.setAttribute("data-feature", key);
          link.addEventListener("click", function () { open(site, x[0]); });
          var lab = ((d.labels || {})[site] || {})[x[0]];
          if (lab) LS.el("span", "meta", " " + lab, th).setAttribute("data-role", "feature-label");
          var td = LS.el("td", null, null, tr), bar = LS.el("span", null, null, td);
          bar.style.display = "inline-block"; bar.style.height = "9px"; bar.style.marginRight = "6px";
          bar.style.width = Math.max(2, 120 * x[1] / m) + "px"; bar.style.background = "#f08c2e";
          LS.el("span", null, LS.fmt(x[1], 4), td);
        });
      });
    }
    colour();
    select(pos);
  };
})();
