"""``lenscope mixing study``: the analyses of Kobayashi et al. 2024 (§5-6) over a dataset, resumable.

Per sentence and layer: the maps of every scope (:func:`~lenscope.mixing.maps.layer_decompositions`), the
contextualization change between scope pairs (full maps, and lower triangles for causal models), FF-amp's top
token pairs, the mean norm of the FF output against the vector its residual connection bypasses, and the FF
output's mean absolute value per dimension (against the weights ``gamma`` of the norm that follows it, and
the contextualization change by FF recomputed without the 1% of dimensions with the smallest ``gamma``).

Each processed sentence is one line of ``records.jsonl``; the per-dimension sums live in ``state.safetensors``
(with how many records they include), so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data.shared import require_shared
from ..errors import InputError
from ..mixing.analysis import contextualization_change, ff_amp, pre_post_ff, scope_pairs, top_pairs
from ..mixing.maps import check_scopes, layer_decompositions
from ..models.runtime.trace import trace
from ..results import field_values, finite_json, read_summary
from ..stats import pearson, spearman

DATASETS = ("sst2", "wikitext")


# ----------------------------------------------------------------------------------------------
# data


def _named(name: str, rel: str) -> Path:
    return require_shared(rel, f"dataset {name!r}", ", or pass a text file (one sentence per line)")


def _wikitext_sentences(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        line = line.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", line):
            words = s.split()
            if 6 <= len(words) <= 40:
                out.append(s)
    return out


def load_sentences(spec: str, limit: int | None = None) -> tuple[str, list[str]]:
    """``sst2`` (SST-2 dev), ``wikitext`` (sentences of WikiText-2's test split) or a text file with one
    sentence per line. Returns the dataset's name and its sentences (the first ``limit``)."""
    if limit is not None and limit < 1:
        raise InputError("--limit must be at least 1")
    if spec == "sst2":
        rows = _named("sst2", "sst2/dev.tsv").read_text(encoding="utf-8").splitlines()[1:]
        sents = [r.split("\t")[0].strip() for r in rows if r.strip()]
    elif spec == "wikitext":
        sents = _wikitext_sentences(_named("wikitext", "wikitext2/wiki.test.raw").read_text(encoding="utf-8"))
    else:
        p = Path(spec).expanduser()
        if not p.is_file():
            raise InputError(f"{spec!r} is neither a dataset name ({', '.join(DATASETS)}) nor a file")
        try:
            sents = [s.strip() for s in p.read_text(encoding="utf-8").splitlines() if s.strip()]
        except UnicodeDecodeError:
            raise InputError(f"{spec} is not a UTF-8 text file (one sentence per line)") from None
        if not sents:
            raise InputError(f"{spec} holds no sentences (one sentence per line)")
        spec = p.name
    return spec, sents[:limit] if limit else sents


# ----------------------------------------------------------------------------------------------
# one sentence


def _following_norm(A, l: int):
    """The norm applied right after layer ``l``'s second residual connection (whose gamma may cancel FF)."""
    if A.placement == "post":
        return A.layers[l].ln_mlp
    return A.layers[l + 1].ln_attn if l + 1 < A.n_layers else A.final_norm


@torch.no_grad()
def sentence_record(lm, text: str, *, mask_fraction: float = 0.01) -> tuple[dict, torch.Tensor]:
    """All per-layer measures of one sentence, and the FF output's sum of |value| per dimension
    ``(layer, d_model)`` (for the gamma analysis)."""
    A = lm.anatomy
    tr = trace(lm, text)
    n = len(tr.tokens)
    scopes = check_scopes(A, None)
    pairs = scope_pairs(A.placement)
    pre, post = pre_post_ff(A.placement)
    rows = torch.arange(n, device=tr.resid_pre.device)
    rec = {"n": n, "cc_full": {f"{a}->{b}": [] for a, b in pairs}, "cc_lower": {f"{a}->{b}": [] for a, b in pairs},
           "cc_ff": [], "cc_ff_masked": [], "ff_norm": [], "bypass_norm": [], "top": []}
    absums = []
    for l in range(A.n_layers):
        decs, _ = layer_decompositions(A, tr, l, rows, scopes)
        maps = {s: d.parts.norm(dim=-1).double() for s, d in decs.items()}
        for a, b in pairs:
            rec["cc_full"][f"{a}->{b}"].append(contextualization_change(maps[a], maps[b]))
            rec["cc_lower"][f"{a}->{b}"].append(contextualization_change(maps[a], maps[b], lower=True))
        # gamma: drop the dimensions where the following norm's weight is smallest
        norm = _following_norm(A, l)
        d = A.d_model
        k = max(1, int(math.ceil(mask_fraction * d)))
        gamma = norm.weight.double().abs() if norm.weight is not None else torch.ones(d, dtype=torch.float64)
        keep = torch.ones(d, dtype=torch.bool)
        keep[torch.argsort(gamma)[:k]] = False
        masked = decs[post].parts[..., keep.to(decs[post].parts.device)].norm(dim=-1).double()
        rec["cc_ff"].append(contextualization_change(maps[pre], maps[post]))
        rec["cc_ff_masked"].append(contextualization_change(maps[pre], masked))
        ff_out = tr.mlp_write[l].double()
        rec["ff_norm"].append(float(ff_out.norm(dim=-1).mean()))
        rec["bypass_norm"].append(float(tr.resid_mid[l].double().norm(dim=-1).mean()))
        absums.append(ff_out.abs().sum(0).cpu())
        amp = ff_amp(maps[pre], maps[post])
        for i, j, v in top_pairs(amp, 3):
            rec["top"].append([l, i, j, v, tr.tokens[i], tr.tokens[j]])
    return rec, torch.stack(absums)


# ----------------------------------------------------------------------------------------------
# the study


@dataclass(repr=False)
class MixingStudy:
    """Dataset averages per layer (lists indexed by layer). ``cc[kind][pair]``: mean contextualization
    change (``kind`` "full" or "lower"); ``ff_norm`` / ``bypass_norm``: mean norms; ``gamma_pearson`` /
    ``gamma_spearman``: correlation between the following norm's |gamma| and the FF output's mean |value| per
    dimension; ``cc_ff`` / ``cc_ff_masked``: contextualization change by FF with all dimensions / without the 1%
    with the smallest |gamma|; ``top_pairs[l]``: the most FF-amplified token pairs of layer ``l``."""

    model: str
    dataset: str
    placement: str
    n_sentences: int
    skipped: int
    cc: dict
    ff_norm: list
    bypass_norm: list
    gamma_pearson: list
    gamma_spearman: list
    cc_ff: list
    cc_ff_masked: list
    top_pairs: list
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return field_values(self)

    def to_frame(self):
        """One row per layer with every per-layer measure (contextualization changes as ``cc_<pair>``)."""
        import pandas as pd

        df = pd.DataFrame({"layer": range(len(self.ff_norm)), "ff_norm": self.ff_norm,
                           "bypass_norm": self.bypass_norm, "gamma_pearson": self.gamma_pearson,
                           "gamma_spearman": self.gamma_spearman, "cc_ff": self.cc_ff,
                           "cc_ff_masked": self.cc_ff_masked})
        for kind, pairs in self.cc.items():
            for pair, vals in pairs.items():
                df[f"cc_{kind}_{pair}"] = vals
        return df

    def plot(self) -> dict:
        """``{"contextualization", "ff_norms", "gamma"}`` matplotlib figures (paper Fig. 3/6, 7, 8)."""
        from ..viz.mixing_plots import plot_study

        return plot_study(self)

    def pairs_frame(self):
        import pandas as pd

        return pd.DataFrame([dict(layer=l, **p) for l, ps in enumerate(self.top_pairs) for p in ps])

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(_clean(self.to_dict()), indent=1))
        self.to_frame().to_csv(out / "layers.csv", index=False)
        self.pairs_frame().to_csv(out / "ff_amp_top_pairs.csv", index=False)
        for name, fig in self.plot().items():
            fig.savefig(out / f"{name}.png", dpi=130)
        return out

    @classmethod
    def load(cls, out_dir: str | Path) -> MixingStudy:
        return cls(**read_summary(out_dir, "study"))

    def __repr__(self) -> str:
        return (f"MixingStudy({self.model}, {self.dataset}, {self.n_sentences} sentences, "
                f"{len(self.ff_norm)} layers, skipped={self.skipped})")


_clean = finite_json  # the one home: lenscope.results.finite_json


def _nanmean(cols: list[list[float]]) -> list:
    t = torch.tensor(cols, dtype=torch.float64)
    ok = ~torch.isnan(t)
    s = torch.where(ok, t, torch.zeros_like(t)).sum(0)
    c = ok.sum(0)
    return [float(v) if k > 0 else None for v, k in zip((s / c.clamp_min(1)).tolist(), c.tolist())]


def study_job(lm, item: tuple[int, str, int]) -> tuple[dict, torch.Tensor | None, int]:
    """One sentence of a study: ``(record, FF |value| sums or None, tokens)``; a sweep job (see
    :func:`lenscope.distributed.run_sweep`)."""
    from ..models.loading.load import encode

    idx, s, max_tokens = item
    try:
        n = encode(lm, s).numel()
    except InputError:
        n = 0
    if n < 3 or n > max_tokens:
        return {"index": idx, "skipped": True, "n": n}, None, 0
    rec, sums = sentence_record(lm, s)
    return {"index": idx, "skipped": False, **rec}, sums, n


def mixing_study(lm, sentences: list[str], out_dir: str | Path | None = None, *, dataset: str = "text",
                 resume: bool = False, max_tokens: int = 64, progress: bool = True, top_k: int = 10,
                 ray=None, workers: int = 2) -> MixingStudy:
    """Run the analyses over ``sentences`` (one trace each). With ``out_dir`` every sentence's record is kept
    on disk and ``resume=True`` continues an interrupted run. Sentences shorter than 3 or longer than
    ``max_tokens`` tokens are skipped and counted. ``ray`` (True for a local Ray, or a cluster address)
    spreads the sentences over ``workers`` Ray workers; the records, the files and the result are the same as
    the sequential run's."""
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    from ..distributed.records import RECORDS, Records
    from ..distributed.sweep import sweep_map

    A = lm.anatomy
    L, d = A.n_layers, A.d_model
    absum = torch.zeros(L, d, dtype=torch.float64)
    tokens_seen = 0
    state_path = None
    meta = {"model": lm.name, "dataset": dataset, "n": len(sentences), "max_tokens": max_tokens}
    if out_dir is None:
        recs = Records(None)
    else:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state_path = out / "state.safetensors"
        if resume and state_path.exists():
            st = load_file(str(state_path))
            saved = json.loads((out / "state.json").read_text())
            if saved["meta"] != meta:
                raise InputError(f"{out} holds a study of {saved['meta']}; resume it with the same model, data, "
                                 "limit and --max-tokens, or use a new --out folder")
            absum, tokens_seen = st["absum"], saved["tokens"]
            recs = Records(out / RECORDS)
            recs.keep(saved["done"])  # the records the saved sums include (a later one is written again)
        else:
            recs = Records(out / RECORDS, resume=False)
            if not resume:
                for p in (state_path, out / "state.json"):
                    if p.exists():
                        p.unlink()
    records: list[dict] = list(recs.records)
    bar = tqdm(total=len(sentences), initial=len(records), desc=f"mixing study {lm.name}", unit="sent",
               disable=not progress)
    items = [(i, s, max_tokens) for i, s in enumerate(sentences)]
    todo = list(range(len(records), len(items)))
    for _idx, (rec, sums, n) in recs.run(todo, lambda t: sweep_map(study_job, items, t, lm=lm, ray=ray,
                                                                   workers=workers),
                                         to_records=lambda res: [_clean(res[0])]):
        if sums is not None:
            absum += sums.double()
            tokens_seen += n
        records.append(rec)
        if state_path is not None:
            save_file({"absum": absum}, str(state_path) + ".tmp")
            os.replace(str(state_path) + ".tmp", state_path)
            (out / "state.json").write_text(json.dumps({"meta": meta, "done": len(records), "tokens": tokens_seen}))
        bar.update(1)
    bar.close()
    return _summarise(lm, records, absum, tokens_seen, dataset, top_k)


def _summarise(lm, records, absum, tokens_seen, dataset, top_k) -> MixingStudy:
    A = lm.anatomy
    L = A.n_layers
    done = [r for r in records if not r["skipped"]]
    if not done:
        raise InputError("no sentence of the dataset could be analysed (all too short or too long; see --max-tokens)")
    pairs = [f"{a}->{b}" for a, b in scope_pairs(A.placement)]
    nan = float("nan")

    def col(key, sub=None):
        return [[(v if v is not None else nan) for v in (r[key][sub] if sub else r[key])] for r in done]

    cc = {kind: {p: _nanmean(col(f"cc_{kind}", p)) for p in pairs} for kind in ("full", "lower")}
    mean_abs = absum / max(tokens_seen, 1)
    gp, gs = [], []
    for l in range(L):
        norm = _following_norm(A, l)
        g = norm.weight.double().abs().cpu() if norm.weight is not None else torch.ones(A.d_model, dtype=torch.float64)
        gp.append(pearson(g, mean_abs[l]))
        gs.append(spearman(g, mean_abs[l]))
    best: list[list] = [[] for _ in range(L)]
    for r in done:
        for l, i, j, v, ti, tj in r["top"]:
            best[l].append({"value": v, "sentence": r["index"], "i": i, "j": j, "token_i": ti, "token_j": tj})
    best = [sorted(b, key=lambda x: -x["value"])[:top_k] for b in best]
    return MixingStudy(
        model=lm.name, dataset=dataset, placement=A.placement, n_sentences=len(done),
        skipped=len(records) - len(done), cc=cc, ff_norm=_nanmean(col("ff_norm")),
        bypass_norm=_nanmean(col("bypass_norm")), gamma_pearson=gp, gamma_spearman=gs,
        cc_ff=_nanmean(col("cc_ff")), cc_ff_masked=_nanmean(col("cc_ff_masked")), top_pairs=best,
        info={"tokens": tokens_seen, "pre_ff": pre_post_ff(A.placement)[0], "post_ff": pre_post_ff(A.placement)[1]},
    )
