"""Where a steering vector acts: the logit lens and direct logit attribution of a steered run beside the
unsteered one, on one input.

Both runs are traced by the engine (the steered one with the vector added as an edit,
:func:`lenscope.models.runtime.trace.trace`'s ``edits``), and lenscope's own methods read them unchanged:

- the lens trajectory (:func:`lenscope.lenses.trajectory.prediction_trajectory`, logit lens by default) at the
  input's last position: each state's top-1 token, the prediction depth (the state from which the top-1 is the
  run's final answer, :func:`lenscope.lenses.depth.depths_from_agreement`), and the lens's reading of the
  behaviour's measure ``logit(answer_positive) - logit(answer_negative)`` state by state;
- direct logit attribution (:func:`lenscope.attribution.dla.direct_logit_attribution`) of the measure in both runs:
  the difference says which later components carry the effect. The vector itself writes into the residual stream,
  so the steered run's logit has one more part, the vector's own direct effect through the final norm (its traced
  scale) and the unembedding (``steering vector``); with it the differences add up to the change of the measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..attribution.dla import direct_logit_attribution
from ..lenses.depth import depths_from_agreement
from ..lenses.lenses import Lens, LogitLens
from ..lenses.trajectory import prediction_trajectory
from ..models.loading.load import LoadedModel, require_decoder, token_ids
from ..models.runtime.trace import trace
from ..models.weights.readout import Readout
from ..results import Result
from .directions import Direction, direction_dict, steering_edits
from .evaluate import resolve_inputs

RUNS = ("unsteered", "steered")


@dataclass(repr=False)
class SteeringLocus(Result):
    """One input read in an unsteered and a steered run (axis ``run``: unsteered, steered).

    - ``lens_measure (run, state)``: the lens's ``logit(answer_positive) - logit(answer_negative)`` at the last
      position, states 0 (embeddings) .. ``n_layers`` (the model's output); ``top_tokens (run, state)`` its top-1;
      ``depth (run,)``: the prediction depth of the run's answer (-1: settles only at the output);
    - ``dla (run, component)``: direct logit attribution of the measure, ``names`` its components (the steered
      run's last component, ``steering vector``, is the vector's own direct effect; 0 in the unsteered run);
      ``measure (run,)`` the model's measure (before any soft-cap), ``completeness_error (run,)`` how far the
      parts are from it.
    """

    model: str
    direction: dict
    text: str
    tokens: list[str]
    answers: list[str]
    alpha: float
    layers: list[int]
    lens: str
    lens_measure: Tensor
    top_tokens: list[list[str]]
    depth: Tensor
    names: list[str]
    dla: Tensor
    measure: Tensor
    completeness_error: Tensor
    notes: list = field(default_factory=list)

    @property
    def difference(self) -> Tensor:
        """``(component,)``: steered minus unsteered direct logit attribution."""
        return self.dla[1] - self.dla[0]

    def top(self, k: int = 8) -> list[dict]:
        """The ``k`` components whose contribution changed most."""
        d = self.difference
        order = d.abs().argsort(descending=True)[:k].tolist()
        return [{"name": self.names[i], "change": float(d[i]), "unsteered": float(self.dla[0, i]),
                 "steered": float(self.dla[1, i])} for i in order]

    def to_dict(self) -> dict:
        return {"model": self.model, "direction": self.direction, "text": self.text, "tokens": self.tokens,
                "answers": self.answers, "alpha": self.alpha, "layers": self.layers, "lens": self.lens,
                "measure": {r: float(self.measure[k]) for k, r in enumerate(RUNS)},
                "depth": {r: None if int(self.depth[k]) < 0 else int(self.depth[k]) for k, r in enumerate(RUNS)},
                "lens_measure": {r: self.lens_measure[k].tolist() for k, r in enumerate(RUNS)},
                "top_tokens": {r: self.top_tokens[k] for k, r in enumerate(RUNS)},
                "components": [{"name": n, "unsteered": float(a), "steered": float(b), "change": float(b - a)}
                               for n, a, b in zip(self.names, self.dla[0].tolist(), self.dla[1].tolist())],
                "completeness_error": {r: float(self.completeness_error[k]) for k, r in enumerate(RUNS)},
                "notes": list(self.notes)}

    def to_frame(self):
        """One row per component: ``component, unsteered, steered, change``."""
        import pandas as pd

        return pd.DataFrame({"component": self.names, "unsteered": self.dla[0].numpy(),
                             "steered": self.dla[1].numpy(), "change": self.difference.numpy()})

    def plot(self, top: int = 12):
        """The lens's measure by state in both runs, and the components whose contribution changed most."""
        from ..viz.steering_plots import plot_locus

        return plot_locus(self, top=top)

    def __repr__(self) -> str:
        d = self.to_dict()["depth"]
        return (f"SteeringLocus(alpha={self.alpha} at {self.layers}: measure {float(self.measure[0]):.3f} -> "
                f"{float(self.measure[1]):.3f}, depth {d['unsteered']} -> {d['steered']})")


@torch.no_grad()
def steering_locus(lm: LoadedModel, direction: Direction, text: str, answer_positive: str, answer_negative: str,
                   alpha: float, *, layers=None, lens: Lens | None = None) -> SteeringLocus:
    """Trace ``text`` unsteered and with ``alpha * direction.vector`` added at every position of ``resid_pre`` of
    ``layers`` (default: the direction's block) and read both with the lens trajectory and direct logit attribution
    of ``logit(answer_positive) - logit(answer_negative)`` at the last position."""
    require_decoder(lm, "the steering locus", causal=True, instead="steer a causal decoder such as smollm2")
    layers = direction.check(lm, layers)
    (item,), answers = resolve_inputs(lm, [(text, answer_positive, answer_negative)], "the input")
    t_id, f_id = (int(x) for x in answers[0])
    ids = token_ids(lm, text)
    A = lm.anatomy
    lens = lens if lens is not None else LogitLens(A, model_name=lm.name)
    edits = steering_edits(direction, alpha, ids.numel(), layers=layers)
    traces = [trace(lm, ids), trace(lm, ids, edits=edits)]
    readout = Readout.from_anatomy(A)
    u = readout.direction(t_id, f_id)
    L = A.n_layers
    lens_measure, tops, depth, dla, measure, err = [], [], [], [], [], []
    for k, tr in enumerate(traces):
        traj = prediction_trajectory(lm, lens=lens, tr=tr, k=1)
        tops.append([row[-1] for row in traj.top_tokens])
        agree = traj.top_ids[:L, -1] == traj.top_ids[L, -1]
        depth.append(int(depths_from_agreement(agree[:, None])[0]))
        states = torch.cat([tr.resid_pre[:, -1], tr.final_resid[None, -1]]).float()
        lg = torch.stack([lens.logits(states[i], i) if i < L else readout.logits(states[i]) for i in range(L + 1)])
        lens_measure.append(lg[:, t_id] - lg[:, f_id])
        comp = direct_logit_attribution(lm, text, t_id, f_id, tr=tr)
        vals = comp.values.double()
        direct = 0.0
        if k == 1 and alpha != 0:
            s = readout.scale(tr.site("ln_final.in")[-1])
            vec = alpha * direction.vector.to(s.device).float()
            direct = float(readout.part_logits(vec[None], s, u)[0]) * len(layers)
            if 0 in layers and A.embed.norm is not None:  # the embedding part is read from the steered state 0
                vals[comp.names.index("embed")] -= direct / len(layers)
        vals = torch.cat([vals, vals.new_tensor([direct])])
        dla.append(vals)
        measure.append(comp.logit)
        err.append(abs(float(vals.sum()) - comp.logit))
        names = comp.names + ["steering vector"]
    return SteeringLocus(
        model=lm.name, direction=direction_dict(direction), text=item.text, tokens=traces[0].tokens,
        answers=[lm.tokenizer.decode([t_id]), lm.tokenizer.decode([f_id])], alpha=float(alpha), layers=layers,
        lens=getattr(lens, "kind", "logit"), lens_measure=torch.stack(lens_measure).float().cpu(), top_tokens=tops,
        depth=torch.tensor(depth), names=names, dla=torch.stack(dla).float().cpu(),
        measure=torch.tensor(measure, dtype=torch.float64), completeness_error=torch.tensor(err, dtype=torch.float64))


__all__ = ["SteeringLocus", "steering_locus"]
