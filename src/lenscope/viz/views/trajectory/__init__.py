"""The trajectory view: what each layer's residual stream already predicts, through one or more lenses
(``PredictionTrajectory``, whose class declares ``VIEW = "trajectory"``)."""

from __future__ import annotations

from typing import Protocol

from .. import Shown, View, meta_of

TRAJECTORY_FIELDS = ("lens", "tokens", "state_labels", "top_tokens", "topk_tokens", "top_prob", "entropy", "kl",
                     "topk_prob", "causal")


class TrajectoryLike(Protocol):
    """A lens's prediction trajectory (:class:`lenscope.lenses.trajectory.PredictionTrajectory`)."""

    lens: str
    model: str
    tokens: list[str]

    def to_dict(self, digits: int | None = None) -> dict: ...


def trajectory_payload(trajs: TrajectoryLike | list[TrajectoryLike]) -> dict:
    """The ``trajectory`` view: one or more lenses' trajectories on the same text, floats to 4 decimals."""
    if not isinstance(trajs, (list, tuple)):
        trajs = [trajs]
    out = []
    for t in trajs:
        d = t.to_dict(digits=4)
        out.append({k: d[k] for k in TRAJECTORY_FIELDS})
    return {"trajectories": out}


class Trajectory(View):
    key = "trajectory"
    title = "Prediction trajectory"
    blurb = ("What each layer's residual stream already predicts, read through the logit lens "
             "(and a tuned or Patchscope lens when given): top token per layer and position.")
    order = 20
    height = 560

    def show(self, obj) -> Shown:
        trajs = list(obj.values()) if isinstance(obj, dict) else list(obj) if isinstance(obj, (list, tuple)) \
            else [obj]
        lenses = " vs ".join(dict.fromkeys(t.lens for t in trajs))
        return Shown(self.key, trajectory_payload(trajs), meta_of(trajs[0]),
                     f"{self.title} · {lenses} lens · {trajs[0].model}")


VIEW = Trajectory()
