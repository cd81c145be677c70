"""A snapshot of lenscope's outputs, to show that a refactor changes no number (issue 17).

Runs a fixed list of ``lenscope ... --json`` commands (commands of README.md and docs/*.md that run on the
embedded default model ``smollm2``; the slower ones are listed in DROPPED) and a fixed list of Python API calls on the
``tiny:`` model of every decoder family (the trace's fields as norms, direct logit attribution, explain with
every method, activation and path patching, causal tracing, knowledge neurons, logit lens and prediction
depth, context-mixing maps, verify), and writes one JSON file ``{command_or_call: output}``::

    .venv/bin/python benchmarks/snapshot_outputs.py --out before.json
    .venv/bin/python benchmarks/snapshot_outputs.py --out after.json
    .venv/bin/python benchmarks/compare_snapshots.py before.json after.json    # numbers to 1e-6

It measures the lenscope installed in the environment of the Python that runs it (``python -m lenscope``
for the commands), so the same file run by two virtual environments compares two versions of the code.
Public names are imported from the packages ``lenscope``, ``lenscope.attribution``,
``lenscope.interventions``, ``lenscope.lenses`` and ``lenscope.mixing`` only (where a package does not
re-export a name, the modules directly inside it are searched), so a module that moved inside a package
does not break the snapshot.

Everything runs on one torch thread (``OMP_NUM_THREADS=1`` for the commands, ``torch.set_num_threads(1)``
here) with fixed seeds, so two runs of one version agree. Wall-clock fields (``seconds``, ``timings``, ...)
and the code version are removed from the outputs, and the temporary folder and the data folder are
written as ``{tmp}`` and ``{data}``. Options: ``--out FILE`` (default ``snapshot.json``),
``--python-only`` (skip the commands), ``--only SUBSTRING`` (only the entries whose key contains it),
``--all-commands`` (also the slower smollm2 commands left out to keep a run near 8 minutes), ``--families``
(the ``tiny:`` models of the Python calls: ``issue-17``, the default, is the nine of DECODERS and ENCODERS;
``issue-30`` the 18 ``tiny:`` models that existed before issue 30's refactor; ``all`` every ``tiny:`` name of the
installed lenscope; or a comma-separated list of names: two versions compared must run the same list to have the
same entries).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import pkgutil
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}
os.environ.update(THREADS)

REPO = Path(__file__).resolve().parents[1]

IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"  # IOI in the keys
IOI_CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
KEYS = "The keys to the cabinet"
PARIS = "The capital of France is"
EIFFEL = "The Eiffel Tower is located in the city of"

# The commands of README.md and docs/*.md that run on smollm2 (the default model), each with --json (--png /
# --html dropped: pictures, not numbers; no tuned lens is shipped, so the lens commands use the logit lens).
# {tmp} and {data} are filled in when run. Each smollm2 command costs 15-35 s of CPU (10 s of it start-up and
# loading the model; patch --what heads 33 s), so to keep one snapshot near 8 minutes on a loaded 2-core
# machine these are left out (DROPPED), their code being covered by the Python calls on the tiny models:
#   the docs/attribution.md loop explain KEYS --model smollm2 --target ' are' --foil ' is' --method
#   logit|alti|erasure (15-19 s CPU each), patch IOI --what resid --model smollm2, path-patch IOI --senders
#   heads, causal-trace EIFFEL, neurons PARIS, report IOI (33 s wall on an idle core, per README);
# and as slower than a minute, or needing a trained lens or another model: lens train / eval / cbe / detect,
# eval alignment, mixing study, causal-trace-sweep, and the commands on gemma3-270m and minilm.
COMMANDS: list[list[str]] = [
    ["models", "--json"],
    ["verify", "--json"],
    ["components", PARIS, "--model", "smollm2", "--target", " Paris", "--foil", " London", "--json"],
    ["explain", KEYS, "--target", " are", "--foil", " is", "--method", "alti-logit", "--json"],
    ["explain", KEYS, "--method", "alti", "--json"],
    ["mixing", KEYS, "--scope", "atblnff", "--layer", "3", "--json"],
    ["patch", IOI_CLEAN, IOI_CORRUPT, "--target", " Mary", "--foil", " John", "--what", "heads", "--json"],
    ["lens", "show", PARIS, "--model", "smollm2", "--json"],
    ["lens", "depth", PARIS, "--model", "smollm2", "--lens", "logit", "--json"],
]

# Not run by default (see above); --all-commands adds them (about 5 more minutes of CPU).
DROPPED: list[list[str]] = [
    *[["explain", KEYS, "--model", "smollm2", "--target", " are", "--foil", " is", "--method", m, "--json"]
      for m in ("logit", "alti", "erasure")],
    ["patch", IOI_CLEAN, IOI_CORRUPT, "--target", " Mary", "--foil", " John", "--what", "resid", "--model",
     "smollm2", "--json"],
    ["path-patch", IOI_CLEAN, IOI_CORRUPT, "--target", " Mary", "--foil", " John", "--senders", "heads",
     "--model", "smollm2", "--json"],
    ["causal-trace", EIFFEL, "--subject", "The Eiffel Tower", "--target", " Paris", "--model", "smollm2", "--json"],
    ["neurons", PARIS, "--target", " Paris", "--model", "smollm2", "--json"],
    ["report", IOI_CLEAN, "--model", "smollm2", "--target", " Mary", "--foil", " John", "--out",
     "{tmp}/report.html", "--json"],
]

# keys whose values are wall-clock measurements or describe the environment, not the computation
VOLATILE = {"seconds", "timings", "time", "elapsed", "wall_seconds", "cpu_seconds", "wall_seconds_now",
            "seconds_per_example", "cpu_seconds_per_example", "model_seconds", "code_version", "version",
            "load_1min", "loadavg_1min_after", "machine", "started", "finished", "date", "timestamp", "bytes"}

DECODERS = ("gpt2", "gpt-neox", "opt", "bloom", "llama", "qwen2", "gemma3")
ENCODERS = ("bert", "roberta")
EXPLAIN_METHODS = ("logit", "alti-logit", "alti", "grad-norm", "grad-x-input", "ig", "erasure", "value-zeroing")
PATCH_WHAT = ("resid", "attn", "mlp", "heads")
# named lists of tiny: models for --families: issue-17's nine, and issue-30's: every tiny: model that existed before
# issue 30's refactor (commit 23036ce), so a snapshot of that commit and one of a later commit have the same entries
FAMILY_SETS = {
    "issue-17": DECODERS + ENCODERS,
    "issue-30": ("bert", "bloom", "cohere", "falcon", "falcon-new", "gemma3", "gpt-neox", "gpt-oss", "gpt2", "gptj",
                 "llama", "mixtral", "olmoe", "opt", "qwen2", "qwen3-moe", "roberta", "starcoder2"),
}
PACKAGES = ("lenscope", "lenscope.attribution", "lenscope.interventions", "lenscope.lenses", "lenscope.mixing")


# --- finding public names -----------------------------------------------------------------------------------

def public(name: str):
    """``name`` from one of PACKAGES: its top level first, then the modules directly inside it."""
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        if hasattr(mod, name):
            return getattr(mod, name)
    for pkg in PACKAGES[1:]:
        mod = importlib.import_module(pkg)
        for info in pkgutil.iter_modules(mod.__path__):
            try:
                sub = importlib.import_module(f"{pkg}.{info.name}")
            except ImportError:
                continue
            if hasattr(sub, name):
                return getattr(sub, name)
    raise ImportError(f"{name} is in none of {', '.join(PACKAGES)}")


# --- turning outputs into JSON ------------------------------------------------------------------------------

def _number(x: float):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def jsonable(x):
    """Tensors as nested lists (float64), dataclasses as their fields, non-finite floats as strings."""
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.is_floating_point():
            x = x.double()
        return jsonable(x.tolist())
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        return jsonable(x.item())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float):
        return _number(x)
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, Path):
        return str(x)
    return f"<{type(x).__name__}>"


def scrub(x, subs: dict[str, str]):
    """Drop VOLATILE keys; write the temporary and data folders as placeholders."""
    if isinstance(x, dict):
        return {k: scrub(v, subs) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [scrub(v, subs) for v in x]
    if isinstance(x, str):
        for path, mark in subs.items():
            x = x.replace(path, mark)
        return x
    if isinstance(x, float):
        return _number(x)
    return x


# --- the commands -------------------------------------------------------------------------------------------

def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def command_key(args: list[str]) -> str:
    return "lenscope " + shlex.join(args)


def run_command(args: list[str], tmp: Path, data: Path) -> dict:
    filled = [a.replace("{tmp}", str(tmp)).replace("{data}", str(data)) for a in args]
    env = dict(os.environ, **THREADS, LENSCOPE_DATA=str(data), PYTHONUNBUFFERED="1")
    env.pop("CI", None)
    proc = subprocess.run([sys.executable, "-m", "lenscope", *filled], cwd=tmp, env=env, capture_output=True,
                          text=True)
    subs = {str(tmp): "{tmp}", str(data): "{data}"}
    out: dict = {"rc": proc.returncode}
    try:
        out["json"] = scrub(json.loads(proc.stdout), subs)
    except json.JSONDecodeError:
        out["stdout"] = scrub(proc.stdout, subs)
        out["stderr_tail"] = scrub(proc.stderr[-2000:], subs)
    return out


# --- the Python calls ---------------------------------------------------------------------------------------

def trace_norms(tr) -> dict:
    """Every field of a Trace: tensors as shape, total norm and norms along the first axis."""
    import torch

    def norms(t):
        if not isinstance(t, torch.Tensor):
            return jsonable(t)
        t = t.detach().cpu()
        if not t.is_floating_point():
            return {"shape": list(t.shape), "values": t.tolist()}
        t = t.double()
        d = {"shape": list(t.shape), "norm": float(t.norm())}
        if t.ndim >= 2:
            d["norms"] = t.flatten(1).norm(dim=1).tolist()
        return jsonable(d)

    out = {}
    for f in dataclasses.fields(tr):
        v = getattr(tr, f.name)
        out[f.name] = {k: norms(w) for k, w in v.items()} if isinstance(v, dict) else norms(v)
    return out


def tiny_families(spec: str = "issue-17") -> tuple[list[str], list[str]]:
    """The decoder and the encoder ``tiny:`` names of ``--families`` (see the module's docstring)."""
    if spec == "issue-17":  # as issue 17 wrote it (the encoders last)
        return list(DECODERS), list(ENCODERS)
    # which names are encoders: the installed lenscope's families (``tiny_names()``: name -> Family)
    tiny = importlib.import_module("lenscope.models.families").tiny_names()
    if spec in FAMILY_SETS:
        names = list(FAMILY_SETS[spec])
    elif spec == "all":
        names = sorted(tiny)
    else:
        names = [n.strip().removeprefix("tiny:") for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in tiny]
    if unknown:
        raise SystemExit(f"error: no tiny model {', '.join(unknown)} in this lenscope; "
                         f"it has {', '.join(sorted(tiny))}")
    return [n for n in names if not tiny[n].encoder], [n for n in names if tiny[n].encoder]


def python_calls(families: str = "issue-17") -> list[tuple[str, object]]:
    """(key, thunk) for every Python call; each thunk returns a JSON-able object."""
    calls: list[tuple[str, object]] = []
    models: dict = {}
    decoders, encoders = tiny_families(families)

    def lm_of(name):
        if name not in models:
            models.clear()  # one model in memory at a time
            models[name] = public("load")(name)
        return models[name]

    for fam in decoders:
        name = f"tiny:{fam}"

        def add(desc, fn, name=name):
            calls.append((f"python {desc.format(m=name)}", lambda: jsonable(fn(lm_of(name)))))

        add("trace({m}, IOI).norms", lambda lm: trace_norms(public("trace")(lm, IOI_CLEAN)))
        add("verify({m})", lambda lm: public("verify")(lm))
        for by_head in (False, True):
            add(f"direct_logit_attribution({{m}}, IOI, ' Mary', foil=' John', by_head={by_head})",
                lambda lm, by_head=by_head: public("direct_logit_attribution")(lm, IOI_CLEAN, " Mary", foil=" John",
                                                                                by_head=by_head))
        for m in EXPLAIN_METHODS:
            add(f"explain({{m}}, {KEYS!r}, ' are', foil=' is', method={m!r})",
                lambda lm, m=m: public("explain")(lm, KEYS, " are", foil=" is", method=m))
        for what in PATCH_WHAT:
            add(f"activation_patching({{m}}, IOI, IOI_CORRUPT, ' Mary', foil=' John', what={what!r})",
                lambda lm, what=what: public("activation_patching")(lm, IOI_CLEAN, IOI_CORRUPT, " Mary", foil=" John",
                                                                     what=what))
        add("activation_patching({m}, IOI, IOI_CORRUPT, ' Mary', foil=' John', what='resid', noising=True)",
            lambda lm: public("activation_patching")(lm, IOI_CLEAN, IOI_CORRUPT, " Mary", foil=" John", noising=True))
        for senders in ("heads", "attn", "mlp"):
            add(f"path_patching({{m}}, IOI, IOI_CORRUPT, ' Mary', foil=' John', senders={senders!r})",
                lambda lm, senders=senders: public("path_patching")(lm, IOI_CLEAN, IOI_CORRUPT, " Mary", foil=" John",
                                                                     senders=senders))
        add("path_patching({m}, IOI, IOI_CORRUPT, ' Mary', foil=' John', receiver=(1, 0, 'q'))",
            lambda lm: public("path_patching")(lm, IOI_CLEAN, IOI_CORRUPT, " Mary", foil=" John", receiver=(1, 0, "q")))
        add("causal_trace({m}, IOI, 'Mary and John', ' Mary', samples=4)",
            lambda lm: public("causal_trace")(lm, IOI_CLEAN, "Mary and John", " Mary", samples=4))
        add("knowledge_neurons({m}, IOI, ' Mary', steps=8)",
            lambda lm: public("knowledge_neurons")(lm, IOI_CLEAN, " Mary", steps=8))
        add("prediction_trajectory({m}, IOI, k=5, mid=True)",
            lambda lm: public("prediction_trajectory")(lm, IOI_CLEAN, k=5, mid=True))
        add("text_depths({m}, IOI)", lambda lm: public("text_depths")(lm, IOI_CLEAN))
        add("context_mixing({m}, 'The keys to the cabinet are on the table')",
            lambda lm: public("context_mixing")(lm, "The keys to the cabinet are on the table"))
    for fam in encoders:  # Post-LN encoders: what applies to them (no logit lens, DLA or patching)
        name = f"tiny:{fam}"

        def add(desc, fn, name=name):
            calls.append((f"python {desc.format(m=name)}", lambda: jsonable(fn(lm_of(name)))))

        add("trace({m}, IOI).norms", lambda lm: trace_norms(public("trace")(lm, IOI_CLEAN)))
        add("verify({m})", lambda lm: public("verify")(lm))
        for m in ("alti", "value-zeroing"):
            add(f"explain({{m}}, {KEYS!r}, method={m!r})", lambda lm, m=m: public("explain")(lm, KEYS, method=m))
        for m in ("grad-norm", "grad-x-input", "ig", "erasure"):
            add(f"explain({{m}}, {KEYS!r}, ' are', foil=' is', method={m!r}, position=-2)",
                lambda lm, m=m: public("explain")(lm, KEYS, " are", foil=" is", method=m, position=-2))
        add("context_mixing({m}, 'The keys to the cabinet are on the table')",
            lambda lm: public("context_mixing")(lm, "The keys to the cabinet are on the table"))
    return calls


def run_python(key, thunk) -> object:
    import torch

    torch.manual_seed(0)
    try:
        return thunk()
    except Exception as e:  # an error is an output too: it shows up in the comparison
        return {"error": f"{type(e).__name__}: {e}"}


# --- main ---------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="snapshot.json", help="the JSON file to write")
    ap.add_argument("--python-only", action="store_true", help="only the Python calls, not the commands")
    ap.add_argument("--only", default=None, metavar="SUBSTRING", help="only the entries whose key contains it")
    ap.add_argument("--all-commands", action="store_true",
                    help="also the slower smollm2 commands left out by default (DROPPED)")
    ap.add_argument("--families", default="issue-17", metavar="issue-17|issue-30|all|NAME,...",
                    help="the tiny: models of the Python calls (default issue-17: the nine of DECODERS and ENCODERS; "
                    "issue-30: the 18 that existed before issue 30)")
    ap.add_argument("--data", default=os.environ.get("LENSCOPE_DATA", str(REPO.parent / "shared" / "data")),
                    help="the shared data folder (default: $LENSCOPE_DATA, else ../shared/data)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    import lenscope

    print(f"lenscope {getattr(lenscope, '__version__', '?')} from {lenscope.__file__}", file=sys.stderr)
    data = Path(args.data).resolve()
    result: dict = {}
    t_all, c_all = time.perf_counter(), time.process_time() + _child_cpu()
    with tempfile.TemporaryDirectory(prefix="lenscope-snapshot-") as tmp:
        tmp = Path(tmp).resolve()
        if not args.python_only:
            for cmd in COMMANDS + (DROPPED if args.all_commands else []):
                key = command_key(cmd)
                if args.only and args.only not in key:
                    continue
                t0, c0 = time.perf_counter(), _child_cpu()
                result[key] = run_command(cmd, tmp, data)
                wall, cpu = time.perf_counter() - t0, _child_cpu() - c0
                print(f"{wall:7.1f} s ({cpu:6.1f} s CPU)  rc={result[key]['rc']}  {key}", file=sys.stderr, flush=True)
        for key, thunk in python_calls(args.families):
            if args.only and args.only not in key:
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            result[key] = run_python(key, thunk)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            err = " ERROR " + result[key]["error"] if isinstance(result[key], dict) and "error" in result[key] else ""
            print(f"{wall:7.1f} s ({cpu:6.1f} s CPU)  {key}{err}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True, allow_nan=False) + "\n")
    cpu = time.process_time() + _child_cpu() - c_all
    print(f"{len(result)} entries in {time.perf_counter() - t_all:.0f} s ({cpu:.0f} s CPU; load average "
          f"{os.getloadavg()[0]:.1f}) -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
