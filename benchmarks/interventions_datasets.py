"""Issue 10 dataset runs on smollm2: causal tracing averaged over the fact set, and IOI head / path patching
averaged over name-swapped IOI prompts.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/interventions_datasets.py facts --samples 5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/interventions_datasets.py ioi --n 30

Writes under docs/results/interventions/ (per-item JSON lines as it goes, so a cut-off run keeps what it did;
then the averages, a table and a figure).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from machine import cpu_name  # benchmarks/machine.py

import lenscope
from lenscope.interventions import activation_patching, causal_trace, path_patching
from lenscope.models.loading.load import encode

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "interventions"
FACTS = Path("/work/shared/data/facts/facts.jsonl")
IOI = Path("/work/shared/data/logit_explanations/ioi_with_targets/ioi_dataset.csv")
GROUPS = ["first subject token", "middle subject tokens", "last subject token", "first subsequent token",
          "further tokens", "last token"]


def position_groups(subject_positions: list[int], n_pos: int) -> list[list[int]]:
    """ROME's alignment: token positions of one prompt per group (see GROUPS). Every position is in one group
    only: the last token is always "last token" (so for "The capital of France is" the first subsequent token
    " is" counts as the last token, and that group is empty), and a one-token subject is its "last subject
    token" (its "first subject token" group is empty)."""
    s0, s1 = min(subject_positions), max(subject_positions)
    last = n_pos - 1
    first_after = s1 + 1
    return [[s0] if s0 < s1 else [], list(range(s0 + 1, s1)), [s1] if s1 < last else [],
            [first_after] if first_after < last else [], list(range(first_after + 1, last)), [last]]


def grouped(m: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """(layer, pos) -> (layer, group): mean over each group's positions; NaN for an empty group."""
    out = np.full((m.shape[0], len(groups)), np.nan)
    for g, ps in enumerate(groups):
        if ps:
            out[:, g] = m[:, ps].mean(1)
    return out


def run_facts(args) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    facts = [json.loads(x) for x in FACTS.read_text().splitlines() if x.strip()]
    # round-robin over relations, so that a run cut short still covers every relation (and multi-token subjects)
    by_rel: dict = {}
    for f in facts:
        by_rel.setdefault(f["relation"], []).append(f)
    facts = [f for k in range(max(map(len, by_rel.values()))) for fs in by_rel.values() if k < len(fs) for f in [fs[k]]]
    if args.limit:
        facts = facts[: args.limit]
    per_path = OUT / f"facts-traces-s{args.samples}.jsonl"
    if args.summarize_only:
        traces = [json.loads(x) for x in per_path.read_text().splitlines() if x.strip()]
        return summarize_facts(traces, args, sum(d["seconds"] for d in traces))
    lm = lenscope.load("smollm2")
    done = {}
    if per_path.exists():
        for line in per_path.read_text().splitlines():
            d = json.loads(line)
            done[d["prompt"]] = d
    t_all = time.perf_counter()
    with per_path.open("a") as fh:
        for i, f in enumerate(facts):
            if f["prompt"] in done:
                continue
            t0 = time.perf_counter()
            tr = causal_trace(lm, f["prompt"], f["subject"], f["target"], samples=args.samples, window=args.window)
            dt = time.perf_counter() - t0
            d = tr.to_dict()
            d.update(prompt=f["prompt"], relation=f["relation"], seconds=dt)
            fh.write(json.dumps(d) + "\n")
            fh.flush()
            done[f["prompt"]] = d
            print(f"[{i + 1}/{len(facts)}] {f['prompt']!r} p_clean {tr.p_clean:.3f} p_corr {tr.p_corrupted:.3f} "
                  f"{dt:.1f}s", flush=True)
    summarize_facts(list(done.values()), args, time.perf_counter() - t_all)


def summarize_facts(traces: list[dict], args, seconds: float) -> None:
    kinds = ("resid", "mlp", "attn")
    acc = {k: [] for k in kinds}
    for d in traces:
        P = len(d["tokens"])
        groups = position_groups(d["subject_positions"], P)
        for k in kinds:
            acc[k].append(grouped(np.array(d[k]), groups))
    avg = {k: np.nanmean(np.stack(v), 0) for k, v in acc.items()}  # (layer, group)
    counts = {k: (~np.isnan(np.stack(v)[:, 0, :])).sum(0).tolist() for k, v in acc.items()}
    p_clean = float(np.mean([d["p_clean"] for d in traces]))
    p_corr = float(np.mean([d["p_corrupted"] for d in traces]))
    summary = {
        "model": "smollm2", "n_facts": len(traces), "samples": args.samples, "window": args.window,
        "groups": GROUPS, "facts_per_group": counts["resid"], "axes": ["layer", "group"],
        "note": "resid row l = residual stream ENTERING block l (ROME's layer-l output is row l+1)",
        "mean_p_clean": p_clean, "mean_p_corrupted": p_corr,
        "relations": sorted({d["relation"] for d in traces}),
        **{k: np.round(avg[k], 5).tolist() for k in kinds},
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "seconds_this_run": round(seconds, 1),
        "seconds_per_fact": {d["prompt"]: round(d["seconds"], 1) for d in traces},
    }
    (OUT / f"facts-average-s{args.samples}.json").write_text(json.dumps(summary, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    titles = {"resid": "residual stream (entering block l)", "mlp": f"MLP (window {args.window})",
              "attn": f"attention (window {args.window})"}
    cmaps = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}
    for ax, k in zip(axes, kinds):
        im = ax.imshow(avg[k].T, aspect="auto", cmap=cmaps[k], vmin=min(0.0, float(np.nanmin(avg[k]))))
        ax.set_yticks(range(len(GROUPS)))
        ax.set_yticklabels(GROUPS if k == "resid" else [""] * len(GROUPS))
        ax.set_xlabel("layer (window centre)" if k != "resid" else "layer")
        ax.set_title(titles[k])
        fig.colorbar(im, ax=ax, label="AIE")
    fig.suptitle(f"smollm2 causal tracing averaged over {len(traces)} facts ({args.samples} noise samples each); "
                 f"mean p_clean {p_clean:.3f}, p_corrupted {p_corr:.3f}")
    fig.tight_layout()
    fig.savefig(OUT / f"facts-average-s{args.samples}.png", dpi=110)
    print(json.dumps({k: summary[k] for k in ("n_facts", "mean_p_clean", "mean_p_corrupted", "facts_per_group")}))
    for k in kinds:
        a = avg[k]
        print(k, "max per group:", [(GROUPS[g], int(np.nanargmax(a[:, g])), round(float(np.nanmax(a[:, g])), 3))
                                     for g in range(len(GROUPS)) if not np.isnan(a[:, g]).all()])


# ---------------------------------------------------------------------------------------------------- IOI

def ioi_rows(lm, n: int):
    """Name-swapped IOI pairs from the shared IOI csv: clean = the prefix (ends before the IO name), corrupted =
    the same prefix with the two names swapped everywhere (IO <-> S), so the answer flips. Keeps rows where
    both names are one token with a leading space, and the corrupted prompt has the clean one's token length.
    Returns (pairs, skipped counts)."""
    pairs, skipped = [], {"name_not_one_token": 0, "length_differs": 0, "other": 0}
    with IOI.open() as fh:
        for row in csv.DictReader(fh):
            prefix, io, s = row["one_prefix_prefix"], row["one_prefix_word_good"], row["one_prefix_word_bad"]
            if io == s or io not in prefix or s not in prefix:
                skipped["other"] += 1
                continue
            ids_io = lm.tokenizer(" " + io, add_special_tokens=False)["input_ids"]
            ids_s = lm.tokenizer(" " + s, add_special_tokens=False)["input_ids"]
            if len(ids_io) != 1 or len(ids_s) != 1:
                skipped["name_not_one_token"] += 1
                continue
            swapped = prefix.replace(io, "\0").replace(s, io).replace("\0", s)
            a, b = encode(lm, prefix), encode(lm, swapped)
            if a.numel() != b.numel():
                skipped["length_differs"] += 1
                continue
            pairs.append({"clean": prefix, "corrupted": swapped, "io": " " + io, "s": " " + s, "n_tokens": a.numel()})
    skipped["usable"] = len(pairs)
    return pairs[:n], skipped


def run_ioi(args) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    lm = lenscope.load("smollm2")
    pairs, skipped = ioi_rows(lm, args.n)
    if args.summarize_only:
        rows = [json.loads(x) for x in (OUT / "ioi-per-prompt.jsonl").read_text().splitlines() if x.strip()]
        return summarize_ioi(rows, skipped, sum(r["seconds"] for r in rows))
    print(f"{len(pairs)} pairs; skipped {skipped}", flush=True)
    per_path = OUT / "ioi-per-prompt.jsonl"
    done = {}
    if per_path.exists():
        for line in per_path.read_text().splitlines():
            d = json.loads(line)
            done[d["clean"]] = d
    t_all = time.perf_counter()
    with per_path.open("a") as fh:
        for i, p in enumerate(pairs):
            if p["clean"] in done:
                continue
            t0 = time.perf_counter()
            act = activation_patching(lm, p["clean"], p["corrupted"], p["io"], p["s"], what="heads", batch_size=64)
            pp = path_patching(lm, p["clean"], p["corrupted"], p["io"], p["s"], senders="heads")
            d = dict(p, ld_clean=act.clean_metric, ld_corrupted=act.corrupted_metric,
                     heads=act.values.tolist(), heads_raw=act.raw.tolist(), path=pp.values.tolist(),
                     path_raw=pp.raw.tolist(), seconds=time.perf_counter() - t0)
            fh.write(json.dumps(d) + "\n")
            fh.flush()
            done[p["clean"]] = d
            print(f"[{i + 1}/{len(pairs)}] LD clean {act.clean_metric:+.2f} corr {act.corrupted_metric:+.2f} "
                  f"{d['seconds']:.1f}s", flush=True)
    rows = [done[p["clean"]] for p in pairs if p["clean"] in done]
    summarize_ioi(rows, skipped, time.perf_counter() - t_all)


def summarize_ioi(rows: list[dict], skipped: dict, seconds: float) -> None:
    heads = np.stack([np.array(r["heads"]) for r in rows])  # (prompt, layer, head) share restored
    path = np.stack([np.array(r["path"]) for r in rows])
    ld_c = np.array([r["ld_clean"] for r in rows])
    ld_x = np.array([r["ld_corrupted"] for r in rows])
    # pooled: mean change of LD divided by mean (LD_c - LD_x) -- robust to prompts with a small gap
    gap = ld_c - ld_x
    raw_h = np.stack([np.array(r["heads_raw"]) for r in rows])
    raw_p = np.stack([np.array(r["path_raw"]) for r in rows])
    pooled_h = (raw_h - ld_x[:, None, None]).mean(0) / gap.mean()
    pooled_p = (raw_p - ld_x[:, None, None]).mean(0) / gap.mean()
    mean_h, mean_p = heads.mean(0), path.mean(0)
    std_h, std_p = heads.std(0), path.std(0)
    H = mean_h.shape[1]
    order = np.argsort(-np.abs(mean_h).ravel())
    table = []
    for idx in order[:15]:
        layer, h = divmod(int(idx), H)
        table.append({"head": f"L{layer}H{h}", "act_mean": round(float(mean_h[layer, h]), 3),
                      "act_std": round(float(std_h[layer, h]), 3), "act_pooled": round(float(pooled_h[layer, h]), 3),
                      "path_mean": round(float(mean_p[layer, h]), 3), "path_std": round(float(std_p[layer, h]), 3),
                      "path_pooled": round(float(pooled_p[layer, h]), 3),
                      "act_positive_share": round(float((heads[:, layer, h] > 0).mean()), 2)})
    summary = {
        "model": "smollm2", "n_prompts": len(rows), "skipped": skipped,
        "corruption": "IO and S names swapped everywhere in the prefix (same token length); target IO, foil S",
        "metric": "share of LD = logit(IO) - logit(S) restored (denoising), mean over prompts; pooled = "
                  "mean(LD_patched - LD_corr) / mean(LD_clean - LD_corr)",
        "ld_clean_mean": float(ld_c.mean()), "ld_corrupted_mean": float(ld_x.mean()),
        "ld_clean_positive_share": float((ld_c > 0).mean()),
        "top_heads_by_activation_patching": table,
        "axes": ["layer", "head"], "heads_mean": np.round(mean_h, 4).tolist(),
        "path_mean": np.round(mean_p, 4).tolist(),
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "seconds_this_run": round(seconds, 1),
        "seconds_per_prompt_mean": round(float(np.mean([r["seconds"] for r in rows])), 1),
    }
    (OUT / "ioi-heads.json").write_text(json.dumps(summary, indent=1))
    lines = [(f"IOI on smollm2, {len(rows)} prompts (skipped: {skipped}); LD clean {ld_c.mean():+.2f}, "
              f"corrupted {ld_x.mean():+.2f} (mean). Share of LD restored, mean ± std over prompts (pooled)."), "",
             ("| head | activation patching (all positions) | pooled | path patching → logits (direct) | pooled | "
              "share of prompts > 0 (act.) |"), "| --- | --- | --- | --- | --- | --- |"]
    for t in table:
        lines.append(f"| {t['head']} | {t['act_mean']:+.3f} ± {t['act_std']:.3f} | {t['act_pooled']:+.3f} | "
                     f"{t['path_mean']:+.3f} ± {t['path_std']:.3f} | {t['path_pooled']:+.3f} | "
                     f"{t['act_positive_share']:.2f} |")
    (OUT / "ioi-heads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 8))
    for ax, m, title in [(axes[0], mean_h, "activation patching (head, all positions)"),
                         (axes[1], mean_p, "path patching → logits (direct effect)")]:
        v = float(np.abs(m).max())
        im = ax.imshow(m, aspect="auto", cmap="RdBu", vmin=-v, vmax=v)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax, label="share of IO−S logit diff restored")
    fig.suptitle(f"smollm2 IOI, mean over {len(rows)} name-swapped prompts")
    fig.tight_layout()
    fig.savefig(OUT / "ioi-heads.png", dpi=110)


def run_ioi_receiver(args) -> None:
    """Path patching from every earlier head to one receiver head's q/k/v input, on the first ``--n`` IOI pairs."""
    OUT.mkdir(parents=True, exist_ok=True)
    lm = lenscope.load("smollm2")
    pairs, _ = ioi_rows(lm, args.n)
    layer, head, which = args.receiver.split(".")
    vals, t0 = [], time.perf_counter()
    for i, p in enumerate(pairs):
        r = path_patching(lm, p["clean"], p["corrupted"], p["io"], p["s"], senders="heads",
                          receiver=(int(layer), int(head), which))
        vals.append(np.nan_to_num(r.values.numpy(), nan=0.0))
        print(f"[{i + 1}/{len(pairs)}] {time.perf_counter() - t0:.0f}s", flush=True)
    v = np.stack(vals)
    m = v.mean(0)
    order = np.argsort(-np.abs(m).ravel())[:10]
    H = m.shape[1]
    top = [{"head": f"L{int(k) // H}H{int(k) % H}", "mean": round(float(m.ravel()[k]), 4),
            "std": round(float(v.reshape(len(v), -1)[:, k].std()), 4)} for k in order]
    out = {"receiver": args.receiver, "n_prompts": len(pairs), "top_senders": top, "mean": np.round(m, 4).tolist(),
           "cpu": cpu_name(), "threads": torch.get_num_threads(), "seconds": round(time.perf_counter() - t0, 1)}
    (OUT / f"ioi-receiver-{args.receiver}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(top, indent=1))


def run_ioi_head_at(args) -> None:
    """Head patching at one position only (``head_position``): the last token, and S2 (the second mention of S),
    on the first ``--n`` IOI pairs; where a head's effect enters."""
    OUT.mkdir(parents=True, exist_ok=True)
    lm = lenscope.load("smollm2")
    pairs, _ = ioi_rows(lm, args.n)
    res, t0 = {"last": [], "s2": []}, time.perf_counter()
    for i, p in enumerate(pairs):
        ids = encode(lm, p["clean"]).tolist()
        s_id = lm.tokenizer(p["s"], add_special_tokens=False)["input_ids"][0]
        s_pos = [k for k, t in enumerate(ids) if t == s_id]
        for name, hp in (("last", len(ids) - 1), ("s2", s_pos[-1])):
            r = activation_patching(lm, p["clean"], p["corrupted"], p["io"], p["s"], what="heads", head_position=hp,
                                    batch_size=64)
            res[name].append(r.values.numpy())
        print(f"[{i + 1}/{len(pairs)}] {time.perf_counter() - t0:.0f}s", flush=True)
    out = {"n_prompts": len(pairs), "heads": args.heads.split(","), "cpu": cpu_name(),
           "seconds": round(time.perf_counter() - t0, 1)}
    for name in ("last", "s2"):
        v = np.stack(res[name])
        out[name] = {h: {"mean": round(float(v[:, int(h[1:].split("H")[0]), int(h.split("H")[1])].mean()), 4),
                         "std": round(float(v[:, int(h[1:].split("H")[0]), int(h.split("H")[1])].std()), 4)}
                     for h in out["heads"]}
    (OUT / "ioi-heads-at-position.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


@torch.no_grad()
def run_ioi_head_positions(args) -> None:
    """One head patched (denoising) at one position at a time, every position, over the first ``--n`` IOI pairs:
    share of LD restored, grouped by the role of the position (IO1, S1, S2, last, other)."""
    from lenscope.interventions import Edit, run
    from lenscope.models.loading.load import resolve_token

    lm = lenscope.load("smollm2")
    pairs, _ = ioi_rows(lm, args.n)
    layer, head = (int(x) for x in args.head[1:].split("H"))
    roles: dict = {}
    for p in pairs:
        c, x = encode(lm, p["clean"]), encode(lm, p["corrupted"])
        tid, fid = resolve_token(lm, p["io"]), resolve_token(lm, p["s"])
        P = c.numel()
        lg, got = run(lm, torch.stack([c, x]), capture=[("head", layer)])
        ld = lg[:, -1, tid] - lg[:, -1, fid]
        z = got[("head", layer)][0]  # clean (pos, head, d_head)
        rows = torch.arange(P)
        lgp, _ = run(lm, x[None].expand(P, P), [Edit("head", layer, rows, rows, z[rows, head],
                                                      head=torch.full((P,), head))])
        share = ((lgp[:, -1, tid] - lgp[:, -1, fid]) - ld[1]) / (ld[0] - ld[1])
        io_pos = [k for k, t in enumerate(c.tolist()) if t == tid]
        s_pos = [k for k, t in enumerate(c.tolist()) if t == fid]
        for k in range(P):
            n1, n2 = sorted((io_pos[0], s_pos[0]))  # first and second name of "A and B"
            role = ("IO1" if k == io_pos[0] else "S1" if k == s_pos[0] else "S2" if k == s_pos[-1] else
                    "last" if k == P - 1 else "after 1st name" if k == n1 + 1 else "after 2nd name" if k == n2 + 1
                    else "other")
            roles.setdefault(role, []).append(float(share[k]))
    out = {"head": args.head, "n_prompts": len(pairs), "cpu": cpu_name(),
           "share_restored_by_position_role": {
               r: {"mean": round(float(np.mean(v)), 4), "max": round(float(np.max(v)), 4), "n": len(v)}
               for r, v in roles.items()}}
    (OUT / f"ioi-{args.head}-positions.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


# ------------------------------------------------------------------------------- knowledge neurons

PARAPHRASES = {  # written for this run; the first of each is the facts.jsonl prompt
    " Paris": ["The capital of France is", "The capital city of France is", "The capital of France is the city of",
               "The French capital is the city of"],
    " Berlin": ["The capital of Germany is", "The capital city of Germany is", "The capital of Germany is the city of",
                "The German capital is the city of"],
    " Tokyo": ["The capital of Japan is", "The capital city of Japan is", "The capital of Japan is the city of",
               "The Japanese capital is the city of"],
}


def run_neurons(args) -> None:
    from lenscope.interventions import refined_knowledge_neurons

    OUT.mkdir(parents=True, exist_ok=True)
    lm = lenscope.load("smollm2")
    results = []
    for target, prompts in PARAPHRASES.items():
        t0 = time.perf_counter()
        r = refined_knowledge_neurons(lm, prompts, target, share=args.share, steps=args.steps)
        d = r.to_dict()
        d["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(d)
        print(repr(r), "p_base", [round(x, 3) for x in d["p_base"]], "supp", [round(x, 4) for x in d["p_suppressed"]],
              "amp", [round(x, 3) for x in d["p_amplified"]], "ctrl supp",
              [round(x, 3) for x in d["p_control_suppressed"]], f"{d['seconds']}s", flush=True)
    out = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "results": results}
    out.update(cross_suppression(lm, results))
    print(json.dumps(out["cross_fact_suppression_mean_p"], indent=1))
    (OUT / "neurons-refined.json").write_text(json.dumps(out, indent=1))


def cross_suppression(lm, results: list[dict]) -> dict:
    """Specificity check: mean P(target of fact B) over B's paraphrases with fact A's refined neurons set to 0,
    for every (A, B); and with only the neurons that all facts share."""
    from lenscope.interventions.neurons import _edit_probs
    from lenscope.models.loading.load import resolve_token

    sets = {r["target"]: torch.tensor([[n["layer"], n["unit"]] for n in r["neurons"]], dtype=torch.long).reshape(-1, 2)
            for r in results}
    shared = sorted(set.intersection(*[{tuple(x) for x in v.tolist()} for v in sets.values()]))
    named = [(f"{a.strip()} set", v) for a, v in sets.items()]
    named.append((f"shared-by-all ({len(shared)})", torch.tensor(shared, dtype=torch.long).reshape(-1, 2)))
    cross = {}
    for name, v in named:
        for b, prompts in PARAPHRASES.items():
            tid = resolve_token(lm, b)
            ps = [_edit_probs(lm, ids, tid, ids.numel() - 1, [v], [0.0])[0] for ids in (encode(lm, p) for p in prompts)]
            cross[f"{name} -> {b.strip()} prompts"] = round(sum(ps) / len(ps), 4)
    return {"cross_fact_suppression_mean_p": cross, "shared_by_all": shared}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("facts")
    f.add_argument("--samples", type=int, default=10)
    f.add_argument("--window", type=int, default=10)
    f.add_argument("--limit", type=int, default=0)
    f.add_argument("--summarize-only", action="store_true", help="average what the per-fact file holds so far")
    i = sub.add_parser("ioi")
    i.add_argument("--n", type=int, default=30)
    i.add_argument("--summarize-only", action="store_true", help="average what the per-prompt file holds so far")
    r = sub.add_parser("ioi-receiver")
    r.add_argument("--n", type=int, default=5)
    r.add_argument("--receiver", default="23.3.q")
    a = sub.add_parser("ioi-head-at")
    a.add_argument("--n", type=int, default=5)
    a.add_argument("--heads", default="L16H0,L23H3,L29H1,L23H0,L24H4,L29H0")
    hp = sub.add_parser("ioi-head-positions")
    hp.add_argument("--n", type=int, default=30)
    hp.add_argument("--head", default="L16H0")
    k = sub.add_parser("neurons")
    k.add_argument("--share", type=float, default=0.5)
    k.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    {"facts": run_facts, "ioi": run_ioi, "ioi-receiver": run_ioi_receiver, "ioi-head-at": run_ioi_head_at,
     "ioi-head-positions": run_ioi_head_positions, "neurons": run_neurons}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
