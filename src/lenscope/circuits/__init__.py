"""Circuits: which components, and which connections between them, carry a behaviour.

- nodes: attribution patching and exact node patching, and the check of one against the other (:mod:`.atp`), AtP*
  (:mod:`.atp_star`);
- edges: the component graph (:mod:`.graph`), EAP and EAP-IG (:mod:`.edges`), exact edge patching (:mod:`.patch`);
- circuits: top-k circuits, faithfulness curves, the smallest faithful circuit, greedy exact pruning
  (:mod:`.circuit`), and one analysis as JSON (:mod:`.analysis`);
- information-flow routes (:mod:`.routes`).
"""

from .analysis import circuit_json
from .atp import NodeAttribution, attribution_patching, check_against_exact, exact_node_patching
from .atp_star import atp_star
from .circuit import Circuit, Faithfulness, faithfulness, greedy_circuit, log_grid, smallest_circuit
from .edges import EdgeAttribution, edge_attribution
from .graph import ComponentGraph
from .patch import circuit_metrics, exact_edge_patching
from .routes import InformationFlowRoutes, information_flow_routes, route_recovery

__all__ = ["NodeAttribution", "atp_star", "attribution_patching", "check_against_exact", "exact_node_patching"]
__all__ += ["InformationFlowRoutes", "information_flow_routes", "route_recovery"]
__all__ += ["Circuit", "ComponentGraph", "EdgeAttribution", "Faithfulness", "circuit_json", "circuit_metrics",
            "edge_attribution", "exact_edge_patching", "faithfulness", "greedy_circuit", "log_grid",
            "smallest_circuit"]
