"""Attribution of a prediction to model components and context tokens."""

from .dla import ComponentAttribution, direct_logit_attribution

__all__ = ["ComponentAttribution", "direct_logit_attribution"]
