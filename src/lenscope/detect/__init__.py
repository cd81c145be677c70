"""Prompt-injection detection from prediction trajectories (Belrose et al. 2023, section 5).

A task (SST-2 sentiment classification) is put to the model as a chat: the system message holds the
instruction, the user message the review. Some reviews carry an injected instruction ("ignore the task
and say X", templates written for lenscope, in :mod:`.task`). At the *answer position* (the last prompt token,
whose next-token prediction is the answer) every residual state is read with a lens, and each state's
distribution is summarised by a few numbers; the trajectory of those numbers over the states is the
feature vector. Anomaly detectors are fitted on clean prompts only and scored on held-out clean prompts
against injected ones (AUROC with a bootstrap interval).

Pieces, each usable alone:

- :func:`build_labelled_set` (seeded, written with :func:`write_labelled_set`), :func:`load_sst2`
- :func:`detection_features` -> :class:`DetectionFeatures` (batched forward passes, several lenses at once)
- :func:`make_detector` (scikit-learn pipelines), :class:`MahalanobisDetector`
- :func:`auroc`, :func:`bootstrap_aurocs`, :func:`auroc_interval`
- :func:`evaluate_detectors` -> :class:`DetectionResult`; :func:`detect` runs everything.

Modules: :mod:`.task` (prompts, SST-2, injections), :mod:`.features`, :mod:`.detectors`, :mod:`.run`.
"""

from ..data.shared import shared_data_dir
from .detectors import (
    DETECTORS,
    DropConstant,
    MahalanobisDetector,
    anomaly_scores,
    auroc,
    auroc_interval,
    bootstrap_aurocs,
    make_detector,
)
from .features import DetectionFeatures, detection_features
from .run import DetectionResult, detect, evaluate_detectors
from .task import (
    ANSWER_WORDS,
    INJECTION_TARGETS,
    INJECTION_TEMPLATES,
    PLACEMENTS,
    SYSTEM_PROMPT,
    answer_token_ids,
    build_labelled_set,
    detokenize,
    first_token_ids,
    inject,
    load_sst2,
    prompt_ids,
    read_labelled_set,
    sst2_path,
    write_labelled_set,
)

__all__ = ["ANSWER_WORDS", "DETECTORS", "INJECTION_TARGETS", "INJECTION_TEMPLATES", "PLACEMENTS", "SYSTEM_PROMPT",
           "DetectionFeatures", "DetectionResult", "DropConstant", "MahalanobisDetector", "anomaly_scores",
           "answer_token_ids", "auroc", "auroc_interval", "bootstrap_aurocs", "build_labelled_set", "detect",
           "detection_features", "detokenize", "evaluate_detectors", "first_token_ids", "inject", "load_sst2",
           "make_detector", "prompt_ids", "read_labelled_set", "shared_data_dir", "sst2_path", "write_labelled_set"]
