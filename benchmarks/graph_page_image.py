"""A docs image of the attribution-graph page: a saved graph (``AttributionGraph.save``, with its supernodes) drawn
by the view's own page (the one ``lenscope graph --html`` writes) in Debian's chromium through Playwright, the
graph's section captured as a PNG.

    .venv/bin/python benchmarks/graph_page_image.py GRAPH.safetensors --dict DIR --out docs/images/graphs-supernodes.png

``--dict``: the dictionaries' folder, whose cached ``labels.json`` labels the features (optional).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graph", help="a graph file AttributionGraph.save wrote")
    ap.add_argument("--dict", default=None, help="the dictionaries' folder (its labels.json labels the features)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--width", type=int, default=1500)
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    from lenscope.features.dictionaries.labels import labels_for
    from lenscope.features.graphs.graph import AttributionGraph
    from lenscope.viz.views import standalone

    chromium = os.environ.get("LENSCOPE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium: apt-get install chromium, or set LENSCOPE_CHROMIUM")
    g = AttributionGraph.load(args.graph)
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        page_path = Path(tmp) / "graph.html"
        standalone(g, page_path, labels=labels_for(args.dict) if args.dict else None)
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        pg = b.new_page(viewport={"width": args.width, "height": 1000})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(page_path.resolve().as_uri())
        pg.wait_for_selector("body[data-ready='1']", timeout=120_000)
        if errors:
            raise SystemExit(f"the page failed: {errors[:3]}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pg.locator("svg.attr-graph").first.screenshot(path=args.out)
        b.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
