"""Evaluation of explanations against linguistic evidence (``lenscope eval alignment``): datasets with
evidence, alignment metrics (MRR, probes needed, dot product), model accuracy and the per-layer attention/MLP
analysis of Ferrando et al. (2023)."""

from ..data.datasets import BLIMP11, Example, load_dataset, read_contrastive_csv, read_sva
from ..data.ioi import generate_ioi
from .alignment import EVAL_METHODS, evaluate_example, evaluate_examples, load_datasets, run_alignment
from .evidence import prepare
from .metrics import alignment, bootstrap_ci
from .summary import AlignmentSummary, summarise

__all__ = ["BLIMP11", "EVAL_METHODS", "AlignmentSummary", "Example", "alignment", "bootstrap_ci", "evaluate_example",
           "evaluate_examples", "generate_ioi", "load_dataset", "load_datasets", "prepare", "read_contrastive_csv",
           "read_sva", "run_alignment", "summarise"]
