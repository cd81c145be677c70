"""Knowledge neurons (Dai et al. 2022, "Knowledge Neurons in Pretrained Transformers").

A neuron is one hidden unit of an MLP: the input of its down projection (``act(W_in x)``; for gated MLPs
``act(gate) · up``). At the prediction position ``p`` (default: the last token), with ``h_l`` the hidden units of
layer ``l`` on the prompt, the attribution of neuron ``i`` is integrated gradients from a zero baseline, as a
right Riemann sum of ``m`` steps (default 20, all steps of a layer in one batch):

    Attr_l,i = h_l,i / m · Σ_{k=1..m} ∂P(target | h_l,p ← (k/m)·h_l,p) / ∂h_l,i

(only layer ``l``'s units at ``p`` are scaled; everything else runs as usual). Knowledge neurons are those with
``Attr >= threshold × max Attr`` (default 0.2). They are then suppressed (set to 0) or amplified (doubled) at ``p``
and the target's probability is read; the same is done for as many random neurons drawn (seeded) from the same
layers, as a control.

A mixture of experts' neurons are (expert, neuron) pairs: the engine's ``mlp_hidden`` site holds every expert's
units side by side (unit ``e * d_mlp + i`` is neuron ``i`` of expert ``e``), with the router's choice as the model
made it; the experts a token does not use have no units there (0, so their attribution is 0), and
:func:`knowledge_neurons` draws its random controls from the units of the experts the prediction position uses
(:func:`refined_knowledge_neurons`, over prompts routed differently, from all of the layer's units). ``to_frame`` /
``to_dict`` name each neuron's ``expert`` and ``neuron``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError
from ..models.loading.load import LoadedModel, encode, require_decoder, token_ids, token_str
from ..models.runtime.engine import Edit, batches, run
from ..models.runtime.request import Request, position_in, token_texts
from ..models.weights.moe import MoE
from ..results import Result

# the target's probability: unedited, then the neurons and the random control each × 0 and × 2
PROBS = ("p_base", "p_suppressed", "p_amplified", "p_control_suppressed", "p_control_amplified")


@dataclass(repr=False)
class KnowledgeNeurons(Result):
    """Knowledge-neuron attributions of one prompt.

    - ``attributions (layer, d_mlp)``: integrated gradients of P(target) per hidden unit at ``position``
    - ``neurons (neuron, 2)``: (layer, unit) of the neurons above ``threshold × max``, strongest first
    - ``control (neuron, 2)``: random neurons, as many, from the same layers
    - ``p_base``, ``p_suppressed``, ``p_amplified``, ``p_control_suppressed``, ``p_control_amplified``
    - ``completeness (layer,)``: ``P(h) − P(0 at position)`` per layer, which the attributions of a layer sum to
      (up to the Riemann sum's error)
    """

    attributions: Tensor
    neurons: Tensor
    control: Tensor
    completeness: Tensor
    tokens: list[str]
    target: str
    target_id: int
    position: int
    steps: int
    threshold: float
    p_base: float
    p_suppressed: float
    p_amplified: float
    p_control_suppressed: float
    p_control_amplified: float
    seed: int = 0
    model: str = ""
    info: dict = field(default_factory=dict)

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([{"layer": int(layer), "unit": int(u), **_expert_neuron(self.info, u),
                              "attribution": float(self.attributions[layer, u])} for layer, u in self.neurons.tolist()])

    def to_dict(self) -> dict:
        return {
            "model": self.model, "tokens": self.tokens, "target": self.target, "target_id": self.target_id,
            "position": self.position, "steps": self.steps, "threshold": self.threshold,
            "neurons": [{"layer": int(a), "index": int(u), **_expert_neuron(self.info, u),
                         "score": float(self.attributions[a, u])} for a, u in self.neurons.tolist()],
            # the fields: the target's probability before and after each intervention
            "suppress": {"before": self.p_base, "after": self.p_suppressed},
            "amplify": {"before": self.p_base, "after": self.p_amplified},
            "random_control": {"before": self.p_base, "after": self.p_control_suppressed,
                               "after_amplified": self.p_control_amplified},
            "control": self.control.tolist(), **{k: getattr(self, k) for k in PROBS},
            "layer_max": self.attributions.max(1).values.tolist(), "completeness": self.completeness.tolist(),
            "layer_sum": self.attributions.sum(1).tolist(),
        }

    def plot(self, ax=None):
        from ..viz.intervention_plots import plot_knowledge_neurons

        return plot_knowledge_neurons(self, ax=ax)

    def __repr__(self) -> str:
        return (f"KnowledgeNeurons(target={self.target!r}, neurons={len(self.neurons)}, p_base={self.p_base:.4f}, "
                f"p_suppressed={self.p_suppressed:.4f}, p_amplified={self.p_amplified:.4f})")


def _expert_neuron(info: dict, unit: int) -> dict:
    """``{"expert", "neuron"}`` of a mixture of experts' unit (``info["d_mlp"]``: one expert's width), else ``{}``."""
    m = info.get("d_mlp")
    return {} if m is None else {"expert": int(unit) // m, "neuron": int(unit) % m}


def _moe_info(lm: LoadedModel) -> dict:
    mlp = lm.anatomy.layers[0].mlp
    return {"experts": mlp.n_experts, "d_mlp": mlp.d_mlp} if isinstance(mlp, MoE) else {}


def _draw_control(lm: LoadedModel, attr: Tensor, layer: int, g, taken: set) -> tuple[int, int]:
    """A random unit of ``layer`` not in ``taken`` (a mixture of experts: of the experts the position uses, those
    with a non-zero attribution; the others have no units there)."""
    mlp = lm.anatomy.layers[layer].mlp
    if isinstance(mlp, MoE):
        m = mlp.d_mlp
        active = attr[layer].reshape(mlp.n_experts, m).ne(0).any(1).nonzero()[:, 0]
        units = (active[:, None] * m + torch.arange(m)).reshape(-1)
        free = [int(u) for u in units.tolist() if (layer, int(u)) not in taken]
        if not free:
            raise InputError(f"no unit of layer {layer} is left for the random control")
        return layer, free[int(torch.randint(len(free), (1,), generator=g))]
    return _draw_unit(lm, layer, g, taken)


def _draw_unit(lm: LoadedModel, layer: int, g, taken: set) -> tuple[int, int]:
    """A random unit of ``layer`` (over all its hidden units) not in ``taken``."""
    while True:
        u = int(torch.randint(lm_d_mlp(lm, layer), (1,), generator=g))
        if (layer, u) not in taken:
            return layer, u


def _prob(lg: Tensor, pos: int, tid: int) -> Tensor:
    return lg[:, pos].float().softmax(-1)[:, tid]


def neuron_attributions(lm: LoadedModel, ids: Tensor, tid: int, pos: int, *, steps: int = 20,
                        layers=None, batch_size: int = 20) -> tuple[Tensor, Tensor]:
    """Integrated gradients of P(target) per hidden unit at ``pos``: ``(attributions (layer, d_mlp),
    completeness (layer,))``; layers not in ``layers`` are 0."""
    L = lm.anatomy.n_layers
    layers = list(range(L)) if layers is None else [int(x) for x in layers]
    P = ids.numel()
    with torch.no_grad():
        lg, got = run(lm, ids[None], capture=[("mlp_hidden", j) for j in layers])
        p_full = float(_prob(lg, pos, tid)[0])
    h = {j: got[("mlp_hidden", j)][0, pos] for j in layers}  # (d_mlp,)
    d_mlp = h[layers[0]].shape[-1]
    alphas = torch.arange(1, steps + 1, dtype=torch.float32) / steps
    rows = [(j, k) for j in layers for k in range(steps)]  # one row per (layer, step)
    grads = torch.zeros(L, d_mlp)
    p_zero = torch.zeros(L)
    for s, e in batches(len(rows), batch_size):
        chunk = rows[s:e]
        n = e - s
        scaled = torch.stack([float(alphas[k]) * h[j] for j, k in chunk]).detach().requires_grad_(True)
        lay = torch.tensor([j for j, _ in chunk])
        edits = []
        for j in lay.unique().tolist():
            r = (lay == j).nonzero()[:, 0]
            edits.append(Edit("mlp_hidden", j, r, torch.full_like(r, pos), scaled[r]))
        lg, _ = run(lm, ids[None].expand(n, P), edits, grad=True)
        p = _prob(lg, pos, tid)
        (g,) = torch.autograd.grad(p.sum(), scaled)
        for (j, _), gi in zip(chunk, g):
            grads[j] += gi.float().cpu()
    with torch.no_grad():  # P with the layer's units at pos set to 0, for the completeness check
        n = len(layers)
        edits = [Edit("mlp_hidden", j, torch.tensor([i]), torch.tensor([pos]), torch.zeros(1, d_mlp))
                 for i, j in enumerate(layers)]
        lg, _ = run(lm, ids[None].expand(n, P), edits)
        pz = _prob(lg, pos, tid)
        for i, j in enumerate(layers):
            p_zero[j] = p_full - float(pz[i])
    attr = torch.zeros(L, d_mlp)
    for j in layers:
        attr[j] = h[j].float().cpu() * grads[j] / steps
    return attr, p_zero


def knowledge_neurons(lm: LoadedModel, prompt, target=None, *, steps: int = 20, threshold: float = 0.2,
                      position: int = -1, layers=None, batch_size: int = 20, seed: int = 0,
                      max_neurons: int | None = None) -> KnowledgeNeurons:
    """Find the knowledge neurons of ``target`` (default: the model's top prediction) after ``prompt`` and test
    them by suppressing / amplifying them against random neurons. See the module docstring for the equations."""
    require_decoder(lm, "knowledge neurons", instead="use a model with a language-model head")
    if steps < 1 or batch_size < 1:
        raise InputError("steps and batch_size must be at least 1")
    if not 0 < threshold <= 1:
        raise InputError("threshold must lie in (0, 1]")
    ids = token_ids(lm, prompt)
    P = ids.numel()
    pos = position_in(position, P)
    L = lm.anatomy.n_layers
    if layers is not None and any(not 0 <= int(j) < L for j in layers):
        raise InputError(f"layers must lie in 0..{L - 1}")
    with torch.no_grad():
        lg, _ = run(lm, ids[None])
    probs = lg[0, pos].float().softmax(-1)
    tid = Request.of(lm, target).or_top(probs).target
    attr, comp = neuron_attributions(lm, ids, tid, pos, steps=steps, layers=layers, batch_size=batch_size)
    top = float(attr.max())
    if top <= 0:
        raise InputError("no hidden unit has a positive attribution to the target; try another target")
    sel = (attr >= threshold * top).nonzero()
    order = attr[sel[:, 0], sel[:, 1]].argsort(descending=True)
    sel = sel[order]
    if max_neurons is not None:
        sel = sel[:max_neurons]
    g = torch.Generator().manual_seed(seed)
    chosen = {(int(a), int(b)) for a, b in sel.tolist()}
    ctrl = []
    for layer, _ in sel.tolist():  # a random unit of the same layer that is not a knowledge neuron
        ctrl.append(_draw_control(lm, attr, layer, g, chosen))
        chosen.add(ctrl[-1])
    control = torch.tensor(ctrl, dtype=torch.long).reshape(-1, 2)
    ps = _suppress_amplify(lm, ids, tid, pos, sel, control)
    return KnowledgeNeurons(
        attributions=attr, neurons=sel, control=control, completeness=comp, tokens=token_texts(lm, ids),
        target=token_str(lm, tid), target_id=tid, position=pos, steps=steps, threshold=threshold,
        p_base=float(probs[tid]), p_suppressed=ps[0], p_amplified=ps[1], p_control_suppressed=ps[2],
        p_control_amplified=ps[3], seed=seed, model=lm.name, info=_moe_info(lm),
    )


def _suppress_amplify(lm, ids, tid, pos, neurons: Tensor, control: Tensor) -> list[float]:
    """The target's probability with ``neurons`` suppressed (× 0) and amplified (× 2), then the same for the random
    ``control``: the values of ``p_suppressed``, ``p_amplified``, ``p_control_suppressed``, ``p_control_amplified``."""
    return _edit_probs(lm, ids, tid, pos, [neurons, neurons, control, control], [0.0, 2.0, 0.0, 2.0])


@torch.no_grad()
def _edit_probs(lm, ids, tid, pos, sets, factors) -> list[float]:
    """One row per (neuron set, factor): those hidden units at ``pos`` multiplied by the factor."""
    P = ids.numel()
    edits = []
    for row, (neurons, f) in enumerate(zip(sets, factors)):
        for layer in neurons[:, 0].unique().tolist():
            units = neurons[neurons[:, 0] == layer, 1]
            fac = torch.ones(1, lm_d_mlp(lm, layer))
            fac[0, units] = f
            edits.append(Edit("mlp_hidden", layer, torch.tensor([row]), torch.tensor([pos]), fac, mode="scale"))
    lg, _ = run(lm, ids[None].expand(len(sets), P), edits)
    return _prob(lg, pos, tid).tolist()


def lm_d_mlp(lm: LoadedModel, layer: int) -> int:
    """The number of hidden units of block ``layer`` (a mixture of experts: every expert's, side by side)."""
    mlp = lm.anatomy.layers[layer].mlp
    return int(mlp.n_experts * mlp.d_mlp) if isinstance(mlp, MoE) else int(mlp.W_out.shape[0])


@dataclass(repr=False)
class RefinedNeurons(Result):
    """Knowledge neurons refined across paraphrases (Dai et al. 2022, §3.3, "refining by prompt sharing").

    - ``neurons (neuron, 2)``: (layer, unit) found (``Attr >= threshold × max``) in at least ``share`` of the
      prompts, most shared first
    - ``counts (neuron,)``: in how many prompts each of them was found
    - ``coarse_sizes``: the number of coarse neurons of each prompt
    - ``p_base, p_suppressed, p_amplified, p_control_suppressed, p_control_amplified (prompt,)``: the target's
      probability on each prompt with the refined neurons (or as many random units of the same layers) × 0 / × 2
    """

    neurons: Tensor
    counts: Tensor
    control: Tensor
    p_base: Tensor
    p_suppressed: Tensor
    p_amplified: Tensor
    p_control_suppressed: Tensor
    p_control_amplified: Tensor
    prompts: list[str]
    coarse_sizes: list[int]
    target: str
    target_id: int
    share: float
    threshold: float
    steps: int
    seed: int = 0
    model: str = ""
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "prompts": self.prompts, "target": self.target, "share": self.share,
            "threshold": self.threshold, "steps": self.steps, "coarse_sizes": self.coarse_sizes,
            "neurons": [{"layer": int(a), "unit": int(u), **_expert_neuron(self.info, u), "prompts": int(c)}
                        for (a, u), c in zip(self.neurons.tolist(), self.counts.tolist())],
            "control": self.control.tolist(),
            **{k: getattr(self, k).tolist() for k in PROBS},
        }

    def __repr__(self) -> str:
        return (f"RefinedNeurons(target={self.target!r}, prompts={len(self.prompts)}, neurons={len(self.neurons)}, "
                f"coarse={self.coarse_sizes}, share={self.share})")


def refined_knowledge_neurons(lm: LoadedModel, prompts, target, *, share: float = 0.5, threshold: float = 0.2,
                              steps: int = 20, batch_size: int = 20, seed: int = 0) -> RefinedNeurons:
    """Knowledge neurons of ``target`` shared by paraphrases: find each prompt's coarse neurons (as
    :func:`knowledge_neurons`: IG at the last token, ``Attr >= threshold × max``), keep those found in at least
    ``share`` of the prompts (Dai et al.'s p%), and test the kept set on every prompt by suppressing (× 0) and
    amplifying (× 2) it, against as many random units of the same layers (seeded)."""
    require_decoder(lm, "knowledge neurons", instead="use a model with a language-model head")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise InputError("give at least one prompt")
    if not 0 < share <= 1:
        raise InputError("share must lie in (0, 1]")
    if not 0 < threshold <= 1:
        raise InputError("threshold must lie in (0, 1]")
    tid = Request.of(lm, target, need="knowledge neurons").target
    counts: dict[tuple[int, int], int] = {}
    coarse_sizes, ids_all = [], []
    for prompt in prompts:
        ids = encode(lm, prompt)
        ids_all.append(ids)
        attr, _ = neuron_attributions(lm, ids, tid, ids.numel() - 1, steps=steps, batch_size=batch_size)
        top = float(attr.max())
        sel = (attr >= threshold * top).nonzero().tolist() if top > 0 else []
        coarse_sizes.append(len(sel))
        for a, u in sel:
            counts[(a, u)] = counts.get((a, u), 0) + 1
    need = share * len(prompts)
    kept = sorted((k for k, c in counts.items() if c >= need - 1e-9), key=lambda k: (-counts[k], k))
    neurons = torch.tensor(kept, dtype=torch.long).reshape(-1, 2)
    g = torch.Generator().manual_seed(seed)
    chosen = set(counts)
    ctrl = []
    for layer, _ in kept:
        ctrl.append(_draw_unit(lm, layer, g, chosen))
        chosen.add(ctrl[-1])
    control = torch.tensor(ctrl, dtype=torch.long).reshape(-1, 2)
    probs = []
    for ids in ids_all:
        pos = ids.numel() - 1
        with torch.no_grad():
            lg, _ = run(lm, ids[None])
        base = float(_prob(lg, pos, tid)[0])
        edited = _suppress_amplify(lm, ids, tid, pos, neurons, control)
        probs.append([base] + edited)
    pr = torch.tensor(probs).reshape(len(prompts), 5)
    return RefinedNeurons(
        neurons=neurons, counts=torch.tensor([counts[k] for k in kept], dtype=torch.long), control=control,
        p_base=pr[:, 0], p_suppressed=pr[:, 1], p_amplified=pr[:, 2], p_control_suppressed=pr[:, 3],
        p_control_amplified=pr[:, 4], prompts=prompts, coarse_sizes=coarse_sizes, target=token_str(lm, tid),
        target_id=tid, share=share, threshold=threshold, steps=steps, seed=seed, model=lm.name, info=_moe_info(lm),
    )
