"""Applications that run a method over a dataset, resumable and optionally on Ray: the context-mixing study
(:mod:`.mixing_study`, ``lenscope mixing study``) and the causal-tracing sweep over facts (:mod:`.causal_trace`,
``lenscope causal-trace sweep``)."""

from .causal_trace import GROUPS, FactSweep, causal_trace_sweep, fact_job, grouped, load_facts, position_groups
from .mixing_study import DATASETS, MixingStudy, load_sentences, mixing_study, sentence_record, study_job

__all__ = ["DATASETS", "GROUPS", "FactSweep", "MixingStudy", "causal_trace_sweep", "fact_job", "grouped",
           "load_facts", "load_sentences", "mixing_study", "position_groups", "sentence_record", "study_job"]
