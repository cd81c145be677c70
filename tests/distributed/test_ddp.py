"""Data-parallel tuned-lens training under torchrun (2 CPU processes, gloo): the same lens as one process on the
same data, seed and global batch; a checkpoint written by 2 ranks resumes in 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lenscope.distributed import ddp

SCRIPT = Path(__file__).with_name("ddp_train.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _run(args: list[str], ranks: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if ranks == 1:
        cmd = [sys.executable, str(SCRIPT), *args]
    else:
        cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={ranks}", str(SCRIPT), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _params(d: Path) -> dict:
    return load_file(str(d / "params.safetensors"))


def test_shard_covers_every_item_once():
    for n in range(0, 12):
        for w in (1, 2, 3, 5):
            parts = [ddp.shard(n, ddp.Dist(rank=r, world=w)) for r in range(w)]
            got = [i for p in parts for i in range(n)[p]]
            assert got == list(range(n)) and max(len(range(n)[p]) for p in parts) - min(
                len(range(n)[p]) for p in parts) <= 1


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is missing from this environment")
def test_two_ranks_train_the_same_lens_and_resume_across_rank_counts(tmp_path):
    one, two, mixed = tmp_path / "one", tmp_path / "two", tmp_path / "mixed"
    _run([str(one)], 1)
    _run([str(two)], 2)  # batch of 5 sequences: 3 on rank 0, 2 on rank 1
    import json

    assert json.loads((two / "config.json").read_text())["training"]["ranks"] == 2
    a, b = _params(one), _params(two)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4), (k, float((a[k] - b[k]).abs().max()))
    assert any(float(v.abs().max()) > 1e-3 for v in a.values())  # it did train (not the identity)
    # interrupted after 2 steps on 2 ranks, finished on 1 rank
    _run([str(mixed), "2"], 2)
    assert (mixed / "checkpoint.json").exists() and not (mixed / "params.safetensors").exists()
    _run([str(mixed), "-", "resume"], 1)
    c = _params(mixed)
    for k in a:
        assert torch.allclose(a[k], c[k], atol=2e-5, rtol=1e-4), k
