"""Run by tests/distributed/test_ddp.py, in one process or under ``torchrun``: train a tiny tuned lens on a
fixed corpus with ``dist=ddp.from_env()`` (``python ddp_train.py OUT [MAX_STEPS] [resume]``)."""

import sys

import torch

import lenscope
from lenscope.distributed import ddp
from lenscope.lenses import TrainSettings, token_sequences, train_tuned_lens

TEXT = ("When Mary and John went to the store, John gave a drink to Mary.\n"
        "The capital of France is Paris. The keys to the cabinet are on the table.\n") * 40

if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    max_steps = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    resume = len(sys.argv) > 3 and sys.argv[3] == "resume"
    lm = lenscope.load("tiny:llama")
    seqs = token_sequences(lm, TEXT, 32)
    s = TrainSettings(tokens=32 * 5 * 6, seq_len=32, batch_size=5, seed=0, checkpoint_every=2, bf16=False,
                      validation_tokens=128)
    d = ddp.from_env()
    train_tuned_lens(lm, seqs, s, out=out, progress=False, max_steps=max_steps, resume=resume, dist=d)
