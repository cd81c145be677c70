"""Data readers (core): plain text -> token sequences (:mod:`.text`), contrastive datasets with evidence
(:mod:`.datasets`, :mod:`.ioi`) and where the shared data folder is (:mod:`.shared`)."""

from .datasets import BLIMP11, Example, expand_specs, load_dataset, read_contrastive_csv, read_sva
from .ioi import generate_ioi
from .shared import shared_data_dir
from .text import read_text, split_text, token_sequences

__all__ = ["BLIMP11", "Example", "expand_specs", "generate_ioi", "load_dataset", "read_contrastive_csv", "read_sva",
           "read_text", "shared_data_dir", "split_text", "token_sequences"]
