"""Write the fixture that checks lenscope's reading of a cross-layer transcoder circuit-tracer itself wrote.

A second Python, where circuit-tracer 0.5 is installed, builds a small ``CrossLayerTranscoder`` (3 blocks, d_model 8,
width 12, JumpReLU, every weight seeded: the recipe in :data:`PROGRAM`), writes it with its own ``to_safetensors``
and computes its own reconstruction (``forward``) of seeded inputs, in float32 on the CPU. Written to
``tests/models/data/``:

- ``ct_clt/``: circuit-tracer's files (``W_enc_{l}.safetensors``, ``W_dec_{l}.safetensors``) and the
  ``config.yaml`` its cache holds beside them (``model_kind: cross_layer_transcoder``, the hooks);
- ``ct_clt_reference.safetensors``: ``inputs (3, 5, 8)`` and circuit-tracer's ``reconstruction (3, 5, 8)``.

``tests/models/test_clt.py`` reads the folder with lenscope and compares both reconstructions with the equations
in float64.

SOURCE (how the committed files were made)::

    PYTHONPATH=src:. .venv/bin/python benchmarks/ct_clt_fixture.py --ct-python /work/ct-env/bin/python

circuit-tracer 0.5.0, torch 2.13.0+cpu (circuit-tracer's env); CPU, float32.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "models" / "data"

PROGRAM = r'''
import sys, torch, yaml
from safetensors.torch import save_file
from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder
out, ref = sys.argv[1], sys.argv[2]
L, d, w = 3, 8, 12
g = torch.Generator().manual_seed(0)
clt = CrossLayerTranscoder(L, w, d, activation_function="jump_relu", lazy_decoder=False, device=torch.device("cpu"),
                           dtype=torch.float32, feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")
with torch.no_grad():
    clt.W_enc.copy_(torch.randn(L, w, d, generator=g) / d ** 0.5)
    clt.b_enc.copy_(torch.randn(L, w, generator=g) * 0.1)
    clt.b_dec.copy_(torch.randn(L, d, generator=g) * 0.1)
    for i in range(L):
        clt.W_dec[i].copy_(torch.randn(w, L - i, d, generator=g) / w ** 0.5)
    clt.activation_function.threshold.copy_(torch.rand(L, 1, w, generator=g) * 0.3)
clt.to_safetensors(out)
with open(out + "/config.yaml", "w") as f:
    yaml.safe_dump({"model_kind": "cross_layer_transcoder", "feature_input_hook": "mlp.hook_in",
                    "feature_output_hook": "mlp.hook_out"}, f, sort_keys=False)
x = torch.randn(L, 5, d, generator=g)
with torch.no_grad():
    y = clt(x)
save_file({"inputs": x.contiguous(), "reconstruction": y.contiguous()}, ref)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ct-python", default="/work/ct-env/bin/python", help="a Python with circuit-tracer 0.5")
    a = ap.parse_args()
    folder = DATA / "ct_clt"
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([a.ct_python, "-c", PROGRAM, str(folder), str(DATA / "ct_clt_reference.safetensors")],
                   check=True, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    print(f"wrote {folder} and {DATA / 'ct_clt_reference.safetensors'}")


if __name__ == "__main__":
    main()
