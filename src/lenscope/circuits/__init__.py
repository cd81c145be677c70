"""Circuits: which components carry a behaviour. So far attribution patching for nodes (:mod:`.atp`); edge
attribution, AtP*, exact edge patching and faithfulness curves are issue 19's next steps."""

from .atp import NodeAttribution, attribution_patching

__all__ = ["NodeAttribution", "attribution_patching"]
