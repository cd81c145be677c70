"""What viz reads from a result: the attributes each view and plot uses, as protocols.

viz sits below the methods (docs/design.md, "Layers"), so it never names a method's class, not even in a type
hint (``tests/test_layers.py`` counts ``TYPE_CHECKING`` imports too). A function that draws a result takes one
of these protocols (any object with the attributes: the method's dataclass, or a stand-in in a test) or the
view's plain payload (:mod:`lenscope.viz.report.payloads`).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor


class ComponentsLike(Protocol):
    """A direct logit attribution (:class:`lenscope.attribution.ComponentAttribution`)."""

    names: list[str]
    layers: list[int]
    heads: list[int]
    values: Tensor
    target: str | None
    foil: str | None
    foil_id: int | None
    logit: float
    total: float
    completeness_error: float


class ExplanationLike(Protocol):
    """A context attribution of one method (:class:`lenscope.attribution.Explanation`)."""

    method: str
    tokens: list[str]
    scores: Tensor
    target: str | None
    foil: str | None
    invariant_error: float | None
    layer_scores: Tensor | None
    info: dict[str, Any]
    reports_completeness: bool  # its method reports info["completeness_error"]


class TrajectoryLike(Protocol):
    """A lens's prediction trajectory (:class:`lenscope.lenses.trajectory.PredictionTrajectory`)."""

    lens: str
    model: str
    tokens: list[str]

    def to_dict(self, digits: int | None = None) -> dict: ...


class MixingMapsLike(Protocol):
    """One scope's context-mixing maps (:class:`lenscope.mixing.maps.MixingMaps`)."""

    scope: str
    tokens: list[str]
    maps: Tensor
    completeness_error: float


class MixingMatricesLike(Protocol):
    """ALTI or value-zeroing contributions with their rollout (:class:`lenscope.mixing.alti.MixingMatrices`)."""

    method: str
    tokens: list[str]
    contributions: Tensor
    rollout: Tensor | None
    degenerate_rows: int


class RoutesLike(Protocol):
    """Information-flow routes (:class:`lenscope.circuits.routes.InformationFlowRoutes`)."""

    model: str
    tokens: list[str]
    prediction: str
    layers: int
    tau: float
    src: Tensor
    dst: Tensor
    via: Tensor
    importance: Tensor
    nodes: Tensor


class CircuitLike(Protocol):
    """A circuit of the component graph (:class:`lenscope.circuits.circuit.Circuit`)."""

    model: str
    level: str
    method: str
    members: list


class FaithfulnessLike(Protocol):
    """A faithfulness curve (:class:`lenscope.circuits.circuit.Faithfulness`)."""

    total: int
    level: str
    method: str

    def points(self) -> list: ...


class FeatureActivationsLike(Protocol):
    """The features of a prompt (:class:`lenscope.features.result.FeatureActivations`)."""

    tokens: list[str]
    sites: list[str]
    widths: list[int]
    ids: Tensor
    values: Tensor
    l0: Tensor


class FeatureCardLike(Protocol):
    """One feature's card (:class:`lenscope.features.cards.FeatureCard`)."""

    model: str
    site: str
    feature: int

    def to_dict(self) -> dict: ...


class AttributionGraphLike(Protocol):
    """An attribution graph (:class:`lenscope.features.graph.AttributionGraph`)."""

    model: str
    tokens: list[str]
    n_layers: int
    logit_ids: Tensor
    logit_tokens: list[str]
    exactness_error: float
    real_error: float
    tolerance: float

    def to_dict(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> dict: ...
