"""Time how long the attribution-graph page takes to draw in Chromium at 100, 1,000 and 5,000 nodes (issue 45's
target: within 2 s).

    .venv/bin/python benchmarks/bench_graph_page.py --out docs/results/bench-graph-page.json

The graphs are the browser tests' synthetic payloads (``tests/viz/test_graph_page_browser.py``'s
``synthetic_graph``: 16 positions, 24 blocks, about three edges into every node, a third of the feature nodes at the
first position, two supernodes), drawn by the view's own page in Debian's chromium through Playwright (headless,
``--disable-gpu``). Per size and repeat: ``load_s``, from the navigation to the page's own signal that every view is
drawn (``body[data-ready='1']``: the page parsed, its data read, the graph laid out and drawn); ``draw_s``, the
graph's draw function alone run again in the loaded page on a fresh element, with the layout it forces and the next
two animation frames (the paint); ``redraw_s``, the node slider moved once (the nodes hidden or shown again and the
edges redrawn); ``first_token_s``, the first-token switch turned on (every row laid out again, then redrawn). The
median of ``--repeat`` runs is reported per size, the slowest under ``slowest``. Records
``benchmarks/machine.py``'s ``record()`` under ``"machine"`` (a shared 2-core machine's timings vary with what else
runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from machine import record  # noqa: E402

from tests.viz.test_graph_page_browser import graph_page, synthetic_graph  # noqa: E402

DRAW = """async () => {
  const sec = LS.data.sections[0], host = document.createElement("div");
  document.body.appendChild(host);
  const t0 = performance.now();
  LS.sections.graph(host, sec.data, LS.data.meta);
  host.getBoundingClientRect();
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const t = performance.now() - t0;
  host.remove();
  return t / 1000;
}"""

STEP = """async ([sel, how]) => {
  const el = document.querySelector(sel), t0 = performance.now();
  if (how === "slider") { el.value = Number(el.max) / 2; el.dispatchEvent(new Event("input")); }
  else el.click();
  document.querySelector("svg.attr-graph").getBoundingClientRect();
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  return (performance.now() - t0) / 1000;
}"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000,5000")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("LENSCOPE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium: apt-get install chromium, or set LENSCOPE_CHROMIUM")
    machine = record()
    sizes = {}
    with sync_playwright() as p, tempfile.TemporaryDirectory() as tmp:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for n in [int(x) for x in args.sizes.split(",")]:
            d = synthetic_graph(n, hide_first=True, seed=n)
            path = Path(tmp) / f"graph-{n}.html"
            path.write_text(graph_page(d), encoding="utf-8")
            runs = {"load_s": [], "draw_s": [], "redraw_s": [], "first_token_s": []}
            errors: list[str] = []
            for _ in range(args.repeat):
                pg = b.new_page(viewport={"width": 1500, "height": 1000})
                pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                pg.on("pageerror", lambda e: errors.append(str(e)))
                t0 = time.perf_counter()
                pg.goto(path.resolve().as_uri())
                pg.wait_for_selector("body[data-ready='1']", timeout=120_000)
                runs["load_s"].append(time.perf_counter() - t0)
                runs["redraw_s"].append(pg.evaluate(STEP, ["[data-role=graph-threshold]", "slider"]))
                runs["first_token_s"].append(pg.evaluate(STEP, ["[data-role=graph-first-token]", "click"]))
                runs["draw_s"].append(pg.evaluate(DRAW))
                pg.close()
            rec = {"nodes": len(d["nodes"]), "edges": len(d["links"]), "errors": errors[:5],
                   **{k: round(statistics.median(v), 4) for k, v in runs.items()},
                   "slowest": {k: round(max(v), 4) for k, v in runs.items()},
                   "runs": {k: [round(x, 4) for x in v] for k, v in runs.items()}}
            sizes[str(n)] = rec
            print(json.dumps({"n": n, **{k: rec[k] for k in ("edges", "load_s", "draw_s", "redraw_s",
                                                               "first_token_s")}}), flush=True)
        version = b.version
        b.close()
    res = {"machine": machine, "machine_end": record(), "chromium": version, "repeat": args.repeat,
           "target_s": 2.0, "sizes": sizes,
           "max_draw_s": max(r["draw_s"] for r in sizes.values()),
           "slowest_draw_s": max(r["slowest"]["draw_s"] for r in sizes.values()),
           "max_load_s": max(r["load_s"] for r in sizes.values())}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
