"""Every number the README and docs quote with a marker is in its results file.

A marker is an HTML comment right after the number (invisible once rendered), naming a results file (path
from the repository root) and the value's key path in it::

    14.0 s<!-- docs/results/bench-report-smollm2.json: best.timings.total -->
    1.5 MB<!-- docs/results/bench-report-smollm2.json: best.bytes * 1e-6 -->
    0.44<!-- docs/results/bench-tuned-lens-library.json: mean_kl_tuned / mean_kl_logit -->

The key path is dot-separated (an integer indexes a list; a key may hold dots: the longest matching key
wins; no spaces). `` / PATH`` (spaces around the slash) divides by a second value of the same file and
`` * FACTOR`` scales (units: ``* 1e-6`` for bytes to MB, ``* 100`` for a percentage). The quoted number is the
last number on the line before the marker (signs ``+ - −``, thousands commas and exponents allowed; a unit or
``**`` may sit between it and the marker); markers in code blocks and code spans are examples, not quotes. It
matches when the value, rounded to the decimals the number is written with, is the number (``14.0`` matches
14.03; ``8e-8`` matches 7.6e-8).

Every results file a marker names carries a ``"machine"`` record (``benchmarks/machine.py``'s ``record()``:
the command, the CPU, bf16, threads, load, date) whose ``command`` names a committed ``benchmarks/`` script, except
the few files in ``LEGACY`` written before that record existed, each with the reason it is not regenerated. A
results file that a ``--combine`` step merged from run files has those run files committed beside it, in
``<results file's stem>-runs/``, except the files in ``COMBINED_RUNS_LOST``, each with the reason.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Results files written before benchmarks/machine.py's record() existed, which no marker may name without it.
# Each entry says why it is not regenerated; remove it when the file is rewritten with a "machine" record.
LEGACY: dict[str, str] = {
    "docs/results/bench-tuned-lens-library.json":
        "tuned-lens library training run (10 min in a separate .venv-tunedlens); CPU, threads and load are in "
        "docs/lenses.md's benchmark section",
    "docs/results/bench-lenscope.json": "the lenscope half of the same comparison (same reason)",
    "docs/results/bench-report-smollm2-xeon.json":
        "benchmarks/bench_report.py's first run (commit be3263f), on an Intel Xeon with native bfloat16 that this "
        "project no longer runs on; its cpu, threads and load average are top-level fields",
    **{f"docs/results/mixing/{run}/summary.json":
       "`lenscope mixing study` over 200-872 sentences (docs/mixing.md gives each command), 3-10 min of one core each; "
       "written before record() existed" for run in ("minilm-sst2", "minilm-wikitext", "smollm2-sst2", "gemma3-sst2")},
    "docs/results/lens-detect/smollm2/detect.json":
        "`lenscope lens detect` over 872 prompts with a lens trained for it (docs/lens-detect.md gives the commands); "
        "written before record() existed",
    **{f"docs/results/{name}.json": "a lens training of 12-15 min plus a float32 evaluation (docs/lenses.md gives "
       "the commands); written before record() existed"
       for name in ("smollm2-lens-eval", "smollm2-lens-eval-keep-last", "gemma3-270m-lens-eval",
                    "smollm2-lens-eval-transfer-sst2")},
    "docs/results/bench-mixing-minilm.json":
        "benchmarks/bench_mixing.py's older run (cpu, threads, date as top-level fields); up to 512 tokens it takes "
        "minutes of a core, not regenerated with smollm2's shortened run",
    "docs/results/interventions/ioi-heads.json":
        "30 IOI prompts, 18 min of one core (docs/interventions.md gives the command); cpu and threads are top-level "
        "fields, written before record() existed",
    "docs/results/interventions/facts-average-s5.json":
        "causal tracing of 38 facts, 31 min of one core (docs/interventions.md gives the command); cpu and threads are "
        "top-level fields, written before record() existed",
    "docs/results/smollm2-lens-eval-fp32-15min.json":
        "a 15-minute float32 training run plus its evaluation; the JSON's training.fp32_wall15.precision names the CPU",
    "docs/results/smollm2-lens-eval-issue11.json":
        "four lens trainings of 15 min to 1 h; its 'machine' is a hand-written string (CPU, load 8-13, threads)",
    "docs/results/lens-training-step-bench.json":
        "benchmarks/bench_lens_step.py --repeats 2 --fp32 (issue 11) on an Intel Xeon with AVX512-BF16 and AMX that "
        "this project no longer runs on, hand-annotated (its note: date, load, threads); what it compares is "
        "bfloat16 on a CPU that has it natively, which the AMD EPYC cannot measure",
}

# Results files a `--combine` step merged from run files that are not committed (they lived in /tmp). Each entry says
# what the results file keeps of them; the combining scripts now copy the run files into `<stem>-runs/`.
COMBINED_RUNS_LOST: dict[str, str] = {
    "docs/results/bench-tuned-lens-vs-library.json":
        "the four run files of tuned_lens_vs_library.sh were in /tmp/tlbench; the combine step kept each one's JSON "
        "line whole, under defaults.* and matched.*",
    "docs/results/smollm2-lens-15min-issue22.json":
        "train.json, eval-tuned.json and eval-logit.json were in /tmp/lens15-runs on a machine since restarted; the "
        "results file keeps the training record and the per-layer KL and precision@1 the docs quote",
}

MARKER = re.compile(r"<!--\s*(?P<file>[\w./-]+\.json)\s*:\s*(?P<expr>.*?)\s*-->")
NUMBER = re.compile(r"(?<![\w.])[+\-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][+\-−]?\d+)?")
CODE_SPAN = re.compile(r"`[^`]*`")
EXPR = re.compile(r"^(?P<key>\S+)(?:\s+/\s+(?P<div>\S+))?(?:\s+\*\s+(?P<scale>\S+))?$")
SCRIPT = re.compile(r"(?<![\w.-])benchmarks/[\w./-]+\.(?:py|sh)\b")


@dataclass
class Quote:
    doc: str
    line: int
    written: str  # the number as the doc writes it
    file: str
    expr: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.written!r} <- {self.file}: {self.expr}"


def quotes(path: Path) -> list[Quote]:
    """Every marked number of one markdown file."""
    out = []
    fenced = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or line.startswith("    "):  # code blocks show markers as text: examples, not quotes
            continue
        line = CODE_SPAN.sub(lambda c: " " * len(c.group()), line)
        for m in MARKER.finditer(line):
            before = MARKER.sub("", line[: m.start()])  # an earlier marker on the line is not part of the number
            nums = list(NUMBER.finditer(before))
            written = nums[-1].group() if nums else ""
            rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
            out.append(Quote(rel, n, written, m["file"], m["expr"]))
    return out


def resolve(data, key: str):
    """``a.b.0.c`` in nested dicts and lists; a dict key may itself hold dots (the longest key that matches wins)."""
    parts = key.split(".")
    i = 0
    while i < len(parts):
        if isinstance(data, list):
            data, i = data[int(parts[i])], i + 1
        elif isinstance(data, dict):
            for j in range(len(parts), i, -1):
                if ".".join(parts[i:j]) in data:
                    data, i = data[".".join(parts[i:j])], j
                    break
            else:
                raise KeyError(f"no key {parts[i]!r} (has {sorted(data)[:12]})")
        else:
            raise KeyError(f"{parts[i]!r}: {data!r} is not a dict or list")
    return data


def value_of(q: Quote, root: Path = ROOT) -> float:
    m = EXPR.match(q.expr)
    if not m:
        raise ValueError(f"bad marker expression {q.expr!r} (want KEY[ / KEY][ * FACTOR])")
    data = json.loads((root / q.file).read_text())
    v = float(resolve(data, m["key"]))
    if m["div"]:
        v /= float(resolve(data, m["div"]))
    if m["scale"]:
        v *= float(m["scale"])
    return v


def matches(written: str, value: float) -> bool:
    """Whether ``value`` rounds to ``written`` at the precision ``written`` shows."""
    s = written.replace(",", "").replace("−", "-").replace("+", "")
    if not s:
        return False
    num = float(s)
    mant, _, exp = s.lower().partition("e")
    decimals = len(mant.split(".")[1]) if "." in mant else 0
    half = 0.5 * 10.0 ** (int(exp or 0) - decimals)
    return math.isfinite(value) and abs(value - num) <= half * (1 + 1e-9) + 1e-12 * abs(num)


@cache
def committed() -> frozenset[str] | None:
    """The repository's tracked files under benchmarks/ (None outside a git checkout: then a file that exists)."""
    try:
        out = subprocess.run(["git", "ls-files", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return frozenset(out.stdout.split())


def record_problem(data: dict, file: str) -> str | None:
    """None when the machine record's command names committed benchmarks/ scripts (and a --combine step's run
    files are committed beside the results file), else what is wrong."""
    cmd = data["machine"].get("command")
    scripts = SCRIPT.findall(cmd) if isinstance(cmd, str) else []
    if not scripts:
        return f"its machine.command {cmd!r} names no benchmarks/ script (benchmarks/machine.py record())"
    tracked = committed()
    for script in scripts:
        if not (ROOT / script).is_file() or (tracked is not None and script not in tracked):
            return f"its machine.command names {script}, which is not committed"
    if "--combine" in cmd and file not in COMBINED_RUNS_LOST:
        runs = (ROOT / file).with_name(Path(file).stem + "-runs")
        if not runs.is_dir() or not any(runs.glob("*.json")):
            return f"it was combined from run files ({cmd!r}): commit them in {runs.relative_to(ROOT)}/"
    return None


def check(q: Quote, root: Path = ROOT) -> str | None:
    """None when the quote traces to its results file, else what is wrong."""
    path = root / q.file
    if not path.exists():
        return f"{q}: results file missing"
    if not q.written:
        return f"{q}: no number before the marker"
    try:
        v = value_of(q, root)
    except (KeyError, IndexError, ValueError, TypeError) as e:
        return f"{q}: {e}"
    if not matches(q.written, v):
        return f"{q}: the results file says {v!r}"
    data = json.loads(path.read_text())
    if q.file in LEGACY:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("machine"), dict):
        return f"{q}: the results file has no 'machine' record (benchmarks/machine.py record())"
    problem = record_problem(data, q.file)
    return None if problem is None else f"{q}: {problem}"


ALL = [q for doc in DOCS for q in quotes(doc)]


def test_docs_have_markers():
    assert len(ALL) >= 20, f"only {len(ALL)} marked numbers in README.md and docs/"


@pytest.mark.parametrize("q", ALL, ids=str)
def test_marked_number_is_in_its_results_file(q):
    assert check(q) is None, check(q)


def test_legacy_files_exist_and_lack_a_record():
    """The legacy list only holds files that still need it."""
    for f in LEGACY:
        data = json.loads((ROOT / f).read_text())
        assert not isinstance(data.get("machine"), dict), f"{f} has a machine record now: remove it from LEGACY"


def test_combined_files_without_their_runs_are_still_combined_and_quoted():
    """The list of combined results files without committed run files only holds files that need it."""
    quoted = {q.file for q in ALL}
    for f in COMBINED_RUNS_LOST:
        data = json.loads((ROOT / f).read_text())
        assert "--combine" in data["machine"]["command"] and f in quoted, f"{f}: remove it from COMBINED_RUNS_LOST"
        assert not (ROOT / f).with_name(Path(f).stem + "-runs").is_dir(), f"{f}'s runs are committed now"


# ------------------------------------------------------------------------------------------------------------
# the checker itself can fail


def test_checker_rejects_wrong_markers(tmp_path):
    res = {"machine": {"command": "python benchmarks/bench_serve.py --out r.json"},
           "rows": [{"seconds": 14.03, "bytes": 1477989}], "a": 3.0, "path_23.3.q": {"v": [0.5]}}
    (tmp_path / "r.json").write_text(json.dumps(res))
    (tmp_path / "old.json").write_text(json.dumps({"x": 2.0}))
    for name, command in (("nocmd", None), ("noscript", "python x.py"), ("gone", "python benchmarks/nope.py"),
                          ("combined", "python benchmarks/bench_tuned_lens.py --combine /tmp/runs")):
        (tmp_path / f"{name}.json").write_text(json.dumps({"machine": {"command": command}, "x": 2.0}))
    doc = tmp_path / "doc.md"
    doc.write_text(
        "took 14.0 s<!-- r.json: rows.0.seconds --> and 1.5 MB<!-- r.json: rows.0.bytes * 1e-6 -->\n"  # right
        "| ratio | **4.68**<!-- r.json: rows.0.seconds / a --> |\n"  # right: 14.03 / 3 = 4.677
        "dotted key 0.50<!-- r.json: path_23.3.q.v.0 -->\n"  # right: a key holding dots
        "took 14.1 s<!-- r.json: rows.0.seconds -->\n"  # wrong value
        "took 14 s<!-- r.json: rows.0.minutes -->\n"  # no such key
        "took 14 s<!-- r.json: rows.3.seconds -->\n"  # no such row
        "took 14 s<!-- missing.json: rows.0.seconds -->\n"  # no such file
        "took 2 s<!-- old.json: x -->\n"  # no machine record
        "took −1,477,989 bytes<!-- r.json: rows.0.bytes -->\n"  # sign differs
        "took 2 s<!-- nocmd.json: x --> 2 s<!-- noscript.json: x --> 2 s<!-- gone.json: x -->\n"  # no script
        "took 2 s<!-- combined.json: x -->\n"  # combined from run files that are not committed
    )
    qs = quotes(doc)
    assert [q.written for q in qs] == ["14.0", "1.5", "4.68", "0.50", "14.1", "14", "14", "14", "2", "−1,477,989",
                                       "2", "2", "2", "2"]
    errors = [check(q, tmp_path) for q in qs]
    assert errors[:4] == [None, None, None, None]
    assert all(errors[4:]), errors
    assert "says 14.03" in errors[4] and "minutes" in errors[5] and "missing" in errors[7]
    assert "machine" in errors[8]
    assert all("names no benchmarks/ script" in e for e in errors[10:12])
    assert "benchmarks/nope.py, which is not committed" in errors[12]
    assert "commit them in" in errors[13]


@pytest.mark.parametrize("written,value,ok", [
    ("14.0", 14.03, True), ("14.0", 14.06, False), ("14", 13.6, True), ("16,384", 16384, True),
    ("8e-8", 7.6e-8, True), ("8e-8", 9e-8, False), ("+3.41", 3.4149, True), ("−0.62", -0.6199, True),
    ("−0.62", 0.62, False), ("0.273", 0.2726, True), ("1.0", 0.96, True), ("1.0", 0.94, False),
])
def test_rounding_rule(written, value, ok):
    assert matches(written, value) is ok
