"""The worked examples the docs quote, computed into results files (each with ``benchmarks/machine.py``'s record).

    .venv/bin/python benchmarks/docs_numbers.py attribution --out docs/results/docs-attribution-keys.json
    .venv/bin/python benchmarks/docs_numbers.py devices --out docs/results/docs-devices-eps.json
    .venv/bin/python benchmarks/docs_numbers.py interventions --out docs/results/docs-interventions-smollm2.json
    .venv/bin/python benchmarks/docs_numbers.py verify --out docs/results/docs-verify.json

``attribution``: docs/attribution.md's worked example ("The keys to the cabinet" -> " are" vs " is" on smollm2:
the scores of logit, alti-logit, alti and erasure with their checks), the table of ``f(alpha * e)`` near the zero
baseline, and integrated gradients' completeness error at 16/32/64 steps (smollm2 and gemma3-270m).

``devices``: docs/devices.md's table of verify's errors in reduced precision, in units of the dtype's eps: the
worst relative (max-scaled) error over every sub-layer check, attention probabilities, logits / max |logit|,
the context-mixing completeness over all scopes of layers 0, 5 and the last, and direct logit attribution's
completeness / |logit|; for smollm2 and gemma3-270m in bfloat16 and float16 and every ``tiny:`` family.

``verify``: the README's ``lenscope verify`` numbers: ``VerifyReport.to_dict()`` for smollm2 and gemma3-270m.

``interventions``: docs/interventions.md's single-prompt examples on smollm2 (``lenscope patch``, ``causal-trace``,
``path-patch``, ``neurons`` with their defaults): each result's ``to_dict()`` and its wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from machine import record  # noqa: E402

import lenscope  # noqa: E402

KEYS = ("The keys to the cabinet", " are", " is")
ALPHAS = (0.0, 1e-12, 1e-10, 1e-8, 1e-7, 1e-6, 1e-4, 1e-2, 0.3, 1.0)


def _scores(e) -> dict:
    return {"tokens": e.tokens, "scores": [float(x) for x in e.scores],
            "invariant_error": None if e.invariant_error is None else float(e.invariant_error),
            "info": {k: v for k, v in e.info.items() if isinstance(v, (int, float, str, bool)) or v is None}}


def f_of_alpha(lm, text, target, foil, alphas, dtype=torch.float32) -> list[float]:
    """``f(alpha e) = logit[target] - logit[foil]`` at the last position with input embeddings scaled by alpha."""
    from lenscope.attribution.baselines import model_logits
    from lenscope.models.loading.load import resolve_token, token_ids

    t, f = resolve_token(lm, target), resolve_token(lm, foil)
    with torch.no_grad():
        e = lm.model.get_input_embeddings()(token_ids(lm, text)[None])[0].detach()
    out = []
    model = lm.model.to(dtype)
    try:
        with torch.no_grad():
            for a in alphas:
                vec = model_logits(lm, inputs_embeds=(a * e.to(dtype))[None])[:, -1]
                out.append(float((vec[:, t] - vec[:, f])[0]))
    finally:
        lm.model.to(torch.float32)
    del model
    return out


def attribution() -> dict:
    text, target, foil = KEYS
    lm = lenscope.load("smollm2")
    tr = lenscope.trace(lm, text)
    res: dict = {"text": text, "target": target, "foil": foil, "model": "smollm2", "methods": {}}
    for m in ("logit", "alti-logit", "alti", "erasure"):
        e = lenscope.explain(lm, None if m != "erasure" else text, target, foil, method=m,
                             tr=tr if m != "erasure" else None)
        res["methods"][m] = _scores(e)
    logits = tr.logits[-1]
    ids = [lm.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (target, foil)]
    res["logit_difference"] = float(logits[ids[0]] - logits[ids[1]])
    res["f_of_alpha"] = {"alpha": list(ALPHAS), "float32": f_of_alpha(lm, text, target, foil, ALPHAS),
                         "float64": f_of_alpha(lm, text, target, foil, ALPHAS, torch.float64)}
    res["ig_completeness_error"] = {"smollm2": {}, "gemma3-270m": {}}
    for steps in (16, 32, 64):
        e = lenscope.explain(lm, text, target, foil, method="ig", steps=steps)
        res["ig_completeness_error"]["smollm2"][str(steps)] = float(e.info["completeness_error"])
    del lm, tr
    g = lenscope.load("gemma3-270m")
    for steps in (16, 64):
        e = lenscope.explain(g, text, target, foil, method="ig", steps=steps)
        res["ig_completeness_error"]["gemma3-270m"][str(steps)] = float(e.info["completeness_error"])
    return res


def eps_row(lm, text: str | None = None) -> dict:
    """verify's worst errors in units of eps, and the decompositions' completeness (see the module doc)."""
    from lenscope.mixing.maps import context_mixing
    from lenscope.models.runtime.verify import DEFAULT_TEXT

    text = text or DEFAULT_TEXT
    rep = lenscope.verify(lm, text)
    eps = torch.finfo(getattr(torch, rep.dtype)).eps
    rel = max([rep.embed_rel_error] + [v for r in rep.layers for k, v in r.items()
                                       if k not in ("layer", "attn_probs")])
    probs = max(r["attn_probs"] for r in rep.layers)
    row = {"dtype": rep.dtype, "eps": eps, "ok": rep.ok, "nonfinite": rep.nonfinite,
           "relative_max_scaled_eps": rel / eps, "attn_probs_eps": probs / eps}
    tr = lenscope.trace(lm, text)
    if rep.max_abs_logit_error is not None:
        row["logits_over_max_logit_eps"] = rep.max_abs_logit_error / max(1.0, float(tr.logits.abs().max())) / eps
    L = lm.anatomy.n_layers
    maps = context_mixing(lm, tr=tr, layers=sorted({0, min(5, L - 1), L - 1}), check=False)
    worst = max(float(m.completeness_error) for m in maps.values())
    row["mixing_completeness_eps"] = worst / eps
    if lm.anatomy.unembed is not None and lm.anatomy.causal:
        top = int(tr.logits[-1].argmax())
        dla = lenscope.direct_logit_attribution(lm, text, f"#{top}")
        row["dla_completeness_over_logit_eps"] = float(dla.completeness_error) / abs(float(tr.logits[-1, top])) / eps
    return row


def devices(models: list[str]) -> dict:
    from lenscope.models.families import tiny_names

    res: dict = {"rows": {}}
    for name in models:
        names = [f"tiny:{n}" for n in sorted(tiny_names())] if name == "tiny" else [name]
        for n in names:
            for dt in ("bfloat16", "float16"):
                lm = lenscope.load(n, dtype=dt)
                try:
                    row = eps_row(lm)
                except Exception as e:  # noqa: BLE001 - an overflow is a result here, written down
                    row = {"dtype": dt, "error": f"{type(e).__name__}: {e}"[:300]}
                res["rows"][f"{n}/{dt}"] = row
                print(n, dt, json.dumps(row), flush=True)
                del lm
    tiny = {k: v for k, v in res["rows"].items() if k.startswith("tiny:") and "error" not in v}
    if tiny:
        keys = ("relative_max_scaled_eps", "attn_probs_eps", "logits_over_max_logit_eps", "mixing_completeness_eps",
                "dla_completeness_over_logit_eps")
        res["tiny_worst"] = {k: max(v.get(k, 0.0) for v in tiny.values()) for k in keys}
    return res


IOI = ("When Mary and John went to the store, John gave a drink to",
       "When Mary and John went to the store, Mary gave a drink to", " Mary", " John")


def interventions() -> dict:
    import time

    from lenscope.interventions import activation_patching, causal_trace
    from lenscope.interventions.neurons import knowledge_neurons
    from lenscope.interventions.paths import path_patching

    lm = lenscope.load("smollm2")
    clean, corrupted, target, foil = IOI
    runs = {
        "patch_resid": lambda: activation_patching(lm, clean, corrupted, target, foil, what="resid"),
        "patch_heads": lambda: activation_patching(lm, clean, corrupted, target, foil, what="heads"),
        "path_heads_logits": lambda: path_patching(lm, clean, corrupted, target, foil, senders="heads"),
        "path_heads_23.3.q": lambda: path_patching(lm, clean, corrupted, target, foil, senders="heads",
                                                   receiver=(23, 3, "q")),
        "neurons": lambda: knowledge_neurons(lm, "The capital of France is", " Paris"),
        "causal_trace": lambda: causal_trace(lm, "The Eiffel Tower is located in the city of", "The Eiffel Tower",
                                             " Paris"),
    }
    res: dict = {"model": "smollm2", "ioi": {"clean": clean, "corrupted": corrupted, "target": target, "foil": foil}}
    for key, fn in runs.items():
        t = time.perf_counter()
        r = fn()
        res[key] = {"seconds": round(time.perf_counter() - t, 2), **r.to_dict()}
        print(key, res[key]["seconds"], "s", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["attribution", "devices", "interventions", "verify"])
    ap.add_argument("--models", default="smollm2,gemma3-270m,tiny", help="devices: the models ('tiny': every family)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    machine = record()
    res = {"attribution": attribution, "interventions": interventions,
           "verify": lambda: {m: lenscope.verify(lenscope.load(m)).to_dict() for m in ("smollm2", "gemma3-270m")},
           "devices": lambda: devices(a.models.split(","))}[a.what]()
    res["machine"] = machine
    Path(a.out).write_text(json.dumps(res, indent=1, default=lambda x: None if isinstance(x, float) and
                                      not math.isfinite(x) else str(x)) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "methods"}, indent=1)[:3000])


if __name__ == "__main__":
    main()
