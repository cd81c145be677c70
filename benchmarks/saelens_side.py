"""SAELens's side of ``benchmarks/bench_dict_saelens.py``, run with the python of an environment that has
``sae-lens`` (not lenscope's): ``SAELENS_PYTHON benchmarks/saelens_side.py CONFIG.json``.

Trains SAELens's ``TopKTrainingSAE`` with its own ``SAETrainer`` on the training rows of the activations file
(safetensors; the tensor ``activations``), fed the batches lenscope's trainer would take in the same order (blocks
of ``buffer`` rows read in order, cycling, each shuffled by ``torch.randperm`` from a generator seeded with
``seed``), normalised by SAELens's ``ActivationScaler`` with the given fixed factor (folded into the weights by
``fit``), and writes the inference weights with SAELens's ``save_inference_model`` (``cfg.json`` and
``sae_weights.safetensors``) to ``out_dir``, the timings of the training (wall and CPU seconds around
``SAETrainer(...)`` and ``fit()``), the learning rate of every step, the versions, and the explained variance of
the held-out rows as SAELens's own inference ``SAE`` reconstructs them to ``result``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def batches(x, steps: int, batch_size: int, buffer: int, seed: int, box: dict):
    """lenscope's ``train_dictionaries`` over a ``FileSource`` of ``x``: the same blocks, permutations and batches
    (records the optimizer's learning rate as each batch is taken, i.e. the rate of that step)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    n, start, step = len(x), 0, 0
    while True:
        rows_n = min(buffer, max(1, steps - step) * batch_size)
        rows = x[(torch.arange(rows_n) + start) % n]
        start += rows_n
        perm = torch.randperm(rows_n, generator=gen)
        for b in range(rows_n // batch_size):
            trainer = box.get("trainer")
            if trainer is not None:
                box["lrs"].append(trainer.optimizer.param_groups[0]["lr"])
            yield rows[perm[b * batch_size:(b + 1) * batch_size]]
            step += 1


def own_explained_variance(cfg: dict, chunk: int = 8192) -> float:
    """The explained variance of the saved dictionary on the held-out rows as SAELens itself runs it
    (``SAE.load_from_disk``, ``forward``): the check that lenscope reads SAELens's weights as SAELens does."""
    import torch
    from sae_lens import SAE
    from safetensors import safe_open

    with safe_open(cfg["activations"], "pt") as f:
        x = f.get_slice("activations")[cfg["n_train"]:cfg["n_train"] + cfg["held_out"]]
    sae = SAE.load_from_disk(cfg["out_dir"])
    sse, s, ss = 0.0, torch.zeros(x.shape[1], dtype=torch.float64), 0.0
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            xc = x[i:i + chunk]
            sse += float((xc.double() - sae(xc).double()).pow(2).sum())
            s += xc.double().sum(0)
            ss += float(xc.double().pow(2).sum())
    return 1.0 - sse / (ss - float(s.pow(2).sum()) / len(x))


def main(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    torch.set_num_threads(cfg["threads"])
    import sae_lens
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from safetensors import safe_open

    with safe_open(cfg["activations"], "pt") as f:
        x = f.get_slice("activations")[:cfg["n_train"]].contiguous()
    d = x.shape[1]
    bs, steps = cfg["batch_size"], cfg["steps"]
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # the first Adam imports torch._dynamo: not timed
    torch.manual_seed(cfg["seed"])  # SAELens initialises from torch's global generator
    box = {"lrs": []}
    w0, c0 = time.perf_counter(), time.process_time()
    sae_cfg = TopKTrainingSAEConfig(d_in=d, d_sae=cfg["width"], k=cfg["k"], dtype="float32", device="cpu",
                                    apply_b_dec_to_input=True, normalize_activations="none",
                                    aux_loss_coefficient=cfg["aux_coefficient"])
    sae = TopKTrainingSAE(sae_cfg)
    if cfg.get("mean_init"):  # lenscope's start of b_dec: the mean of the first block's (normalised) rows
        first = x[torch.arange(min(cfg["buffer"], steps * bs)) % len(x)]
        with torch.no_grad():
            sae.b_dec.copy_((first.double().mean(0) * cfg["scale"]).float())
    tcfg = SAETrainerConfig(total_training_samples=steps * bs, train_batch_size_samples=bs, lr=cfg["lr"],
                            lr_end=cfg["lr"], lr_scheduler_name="constant", lr_warm_up_steps=cfg["warmup_steps"],
                            lr_decay_steps=steps - cfg["warmup_steps"], adam_beta1=cfg["adam_betas"][0],
                            adam_beta2=cfg["adam_betas"][1], device="cpu", autocast=cfg.get("autocast", False),
                            dead_feature_window=cfg["dead_window_steps"],
                            n_checkpoints=0, save_final_checkpoint=False)
    trainer = SAETrainer(tcfg, sae, batches(x, steps, bs, cfg["buffer"], cfg["seed"], box))
    box["trainer"] = trainer
    # lenscope's fixed normalisation factor, as SAELens's own expected_average_only_in estimate would set it: the
    # trainer scales every batch by it and folds it into the weights at the end of fit()
    trainer.activation_scaler.scaling_factor = cfg["scale"]
    trainer.fit()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    sae.save_inference_model(cfg["out_dir"])
    own = own_explained_variance(cfg)
    precision = "bfloat16 (autocast)" if cfg.get("autocast") else "float32"
    Path(cfg["result"]).write_text(json.dumps({
        "tokens": trainer.n_training_samples, "steps": trainer.n_training_steps, "wall_s": wall, "cpu_s": cpu,
        "precision": precision, "lr_schedule": box["lrs"], "threads": torch.get_num_threads(),
        "torch": torch.__version__, "sae_lens": sae_lens.__version__,
        "dead_at_end": int(trainer.dead_neurons.sum()), "saelens_own_explained_variance": own}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
