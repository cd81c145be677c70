"""Data readers (core): plain text -> token sequences (:mod:`.text`), contrastive datasets with evidence
(:mod:`.datasets`, :mod:`.ioi`), clean/corrupted pairs for circuit discovery (:mod:`.contrast`) and where the
shared data folder is (:mod:`.shared`)."""

from .contrast import (
    ContrastPair,
    check_lengths,
    contrast_dataset,
    ioi_contrasts,
    read_contrast_csv,
    sva_contrasts,
    tokenize_with,
    write_contrast_csv,
)
from .datasets import BLIMP11, Example, expand_specs, load_dataset, read_contrastive_csv, read_sva
from .ioi import generate_ioi
from .shared import shared_data_dir
from .text import read_text, split_text, token_sequences

__all__ = ["BLIMP11", "ContrastPair", "Example", "check_lengths", "contrast_dataset", "expand_specs", "generate_ioi",
           "ioi_contrasts", "load_dataset", "read_contrast_csv", "read_contrastive_csv", "read_sva", "read_text",
           "shared_data_dir", "split_text", "sva_contrasts", "token_sequences", "tokenize_with", "write_contrast_csv"]
