"""Circuits: which components carry a behaviour. So far, for nodes: attribution patching, exact patching and the
check of one against the other (:mod:`.atp`); edge attribution, AtP* and faithfulness curves are issue 19's next
steps."""

from .atp import NodeAttribution, attribution_patching, check_against_exact, exact_node_patching
from .atp_star import atp_star
from .routes import InformationFlowRoutes, information_flow_routes, route_recovery

__all__ = ["NodeAttribution", "atp_star", "attribution_patching", "check_against_exact", "exact_node_patching"]
__all__ += ["InformationFlowRoutes", "information_flow_routes", "route_recovery"]
