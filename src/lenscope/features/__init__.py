"""Features: sparse dictionaries (SAEs, transcoders, skip transcoders) trained on a CPU from the model's own
activations, evaluated against baselines, and first-class in lenscope's methods (``docs/features.md``).

The dictionary itself (its equations, its files, its latents as engine sites) is core:
:mod:`lenscope.models.dictionaries.dictionary`, run by :func:`lenscope.models.runtime.engine.run` (``dictionaries=``,
``splice=``); the text stream is :mod:`lenscope.data.corpus`. Here:

- :mod:`~lenscope.features.dictionaries.train`: training (TopK, BatchTopK, JumpReLU), streamed from the engine or from a
  tensor file, time-budgeted and resumable;
- :mod:`~lenscope.features.dictionaries.evaluate`: explained variance, L0, dead latents, density, the splice into the
  model (ΔLM loss, loss recovered, KL), the replacement model, beside the PCA / linear baselines;
- :mod:`~lenscope.features.dictionaries.baselines`: the PCA and least-squares baselines the evaluation fits;
- :mod:`~lenscope.features.dictionaries.synthetic`: the synthetic benchmark with known features;
- :mod:`~lenscope.features.dictionaries.attribution`: direct logit attribution over features, and the features of a
prompt;
- :mod:`~lenscope.features.dictionaries.cards`: one feature seen whole on held-out text (top contexts, histogram,
  density, the tokens its decoder direction promotes and suppresses), many features in one pass.
"""
