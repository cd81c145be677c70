"""Interventions: activation patching and causal tracing, batched, on every family.

Every method runs the model through the engine (:mod:`lenscope.models.runtime.engine`: sites, captures and edits), so
nothing here asks which family it runs on.
"""

from ..models.runtime.engine import Edit, run
from .neurons import KnowledgeNeurons, RefinedNeurons, knowledge_neurons, neuron_attributions, refined_knowledge_neurons
from .patching import PatchingResult, activation_patching
from .paths import path_patching
from .tracing import CausalTrace, causal_trace, embedding_std, subject_positions

__all__ = ["Edit", "PatchingResult", "activation_patching", "run"]
__all__ += ["CausalTrace", "causal_trace", "embedding_std", "subject_positions"]
__all__ += ["path_patching"]
__all__ += ["KnowledgeNeurons", "knowledge_neurons", "neuron_attributions"]
__all__ += ["RefinedNeurons", "refined_knowledge_neurons"]
