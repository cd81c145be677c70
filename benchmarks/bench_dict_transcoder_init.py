"""How a transcoder's encoder should start: tied to the decoder (an SAE's start, Gao et al. 2024) or an independent
random map scaled by ``TRANSCODER_ENC_INIT`` (lenscope's start for transcoders, ``Dictionary.init``); and (``--lrs``)
how fast lenscope's start should learn.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_dict_transcoder_init.py \
        --out docs/results/features/bench-dict-transcoder-init.json
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_dict_transcoder_init.py --starts "" --steps 60 \
        --lrs 3.75e-4,1.5e-3,4e-3,8e-3 --out docs/results/features/bench-dict-transcoder-lr.json

Transcoders (TopK, width 4608, k 32) for smollm2's MLPs at three depths, trained for ``--steps`` steps from each
start on the same streamed rows (the model in bfloat16, ``--rows`` MLP input/output pairs from the corpus's
training part), scored by the explained variance of the MLP's output on the held-out corpus part. A tied start
makes the first outputs a projection of the MLP's *input* onto random directions, which the MLP's output is not:
its explained variance starts far below 0 and a CPU budget spends its steps climbing back.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sites", default="mlp_out.3,mlp_out.15,mlp_out.28")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "corpus"))
    ap.add_argument("--rows", type=int, default=40_960)
    ap.add_argument("--held-out", type=int, default=8_192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--starts", default="tied,lenscope", help="the starts to compare (comma-separated; '' none)")
    ap.add_argument("--lrs", default="", help="learning rates to train lenscope's start at (comma-separated; the "
                    "default is DictSettings' formula, 2e-4 * sqrt(16384 / width))")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()


    import lenscope
    from lenscope.features.dictionaries.evaluate import reconstruction
    from lenscope.features.dictionaries.sources import FileSource, sources
    from lenscope.features.dictionaries.train import DictSettings, train_dictionaries
    from lenscope.models.dictionaries import dictionary as dm

    machine = record()
    lm = lenscope.load(a.model, dtype="bfloat16")
    src, targets = sources("transcoder", lm=lm, sites=a.sites, data=a.data, part="train")
    rows, _ = src.read(0, a.rows)
    held_src, _ = sources("transcoder", lm=lm, sites=a.sites, data=a.data, part="heldout")
    held, _ = held_src.read(0, a.held_out)
    new_init = dm.Dictionary.init.__func__

    def tied(cls, d_in, width, **kw):  # the SAE's start, for the comparison
        D = new_init(cls, d_in, width, **kw)
        D.W_enc = D.W_dec.T.clone()
        return D

    res = {"machine": machine, "model": a.model, "model_dtype": "bfloat16", "sites": a.sites.split(","),
           "rows": int(len(rows)), "held_out": int(len(held)), "steps": a.steps, "width": 4608, "k": 32,
           "transcoder_enc_init": dm.TRANSCODER_ENC_INIT, "starts": {}}
    def trained(init, lr=None):
        dm.Dictionary.init = classmethod(init)
        try:
            s = DictSettings(kind="topk", role="transcoder", width=4608, k=32, tokens=a.steps * 4096,
                             batch_size=4096, buffer=32_768, lr=lr)
            Ds = train_dictionaries(FileSource(rows), targets, s, progress=False)
        finally:
            dm.Dictionary.init = classmethod(new_init)
        evs = {}
        for D, t in zip(Ds, targets):
            evs[t.like.site] = round(reconstruction(D, held[:, t.i_in], held[:, t.i_out])["explained_variance"], 4)
        return {"held_out_explained_variance": evs, "mean": round(sum(evs.values()) / len(evs), 4),
                "lr": s.base_lr(), "history": Ds[0].info["training"]["history"]}

    inits = {"tied": tied, "lenscope": new_init}
    for name in [x for x in a.starts.split(",") if x]:
        res["starts"][name] = trained(inits[name])
        print(name, res["starts"][name]["held_out_explained_variance"], flush=True)
    if a.lrs:
        res["lrs"] = {}
        for lr in [float(x) for x in a.lrs.split(",")]:
            res["lrs"][f"{lr:g}"] = trained(new_init, lr)
            print(f"lr {lr:g}", res["lrs"][f"{lr:g}"]["held_out_explained_variance"], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
