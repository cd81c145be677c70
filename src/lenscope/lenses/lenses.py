"""Logit lens and tuned lens (Belrose et al. 2023).

A lens decodes a residual state through the model's own final norm and unembedding. The states are
numbered like transformers' hidden states: state ``l`` for ``l < n_layers`` is the residual stream
entering block ``l`` (state 0 = embeddings), state ``n_layers`` is the model's last residual state (the
output, where every lens is the identity). With ``mid=True`` a state is the residual stream right after
block ``l``'s attention (``Trace.resid_mid``), the sub-layer view.

Each decoded state uses its own norm statistics: ``final_norm`` is applied to the (translated) state
itself, never with the last layer's scale.

The tuned lens adds one affine translator per state, ``h -> h + h A_l + b_l`` with ``A_l, b_l`` starting
at zero (the identity map), trained so that the decoded distribution matches the model's final one. A lens
may also carry translators for the mid-layer states (``A_mid, b_mid``, trained in the same run with
``TrainSettings(mid=True)``); trajectories and evaluations use them for the ``"l.mid"`` states.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import InputError, NotApplicableError
from ..models.loading.load import LoadedModel
from ..models.loading.summary import fingerprint  # noqa: F401 (re-exported)
from ..models.weights.anatomy import Anatomy

LENS_FORMAT = 1


def decode(anatomy: Anatomy, h: Tensor) -> Tensor:
    """Logits of residual states ``h (..., d_model)`` through the final norm (own statistics) and unembedding."""
    if anatomy.unembed is None:
        raise NotApplicableError(
            "this model has no language-model head, so residual states cannot be decoded into tokens "
            "(minilm is a sentence encoder without its masked-LM head); use a model with a head"
        )
    return anatomy.logits(h)


class Lens(nn.Module):
    """Base class: ``transform(h, layer)`` maps a state into the output space, ``logits`` decodes it."""

    kind = "lens"

    def __init__(self, anatomy: Anatomy, model_name: str = "", mid: bool = False):
        super().__init__()
        self._anatomy = anatomy  # not a submodule: a lens never stores the model's weights
        self.model_name = model_name
        self.n_layers = anatomy.n_layers
        self.d_model = anatomy.d_model
        self.mid = mid

    @property
    def anatomy(self) -> Anatomy:
        return self._anatomy

    def transform(self, h: Tensor, layer: int) -> Tensor:
        raise NotImplementedError

    def transform_all(self, h: Tensor) -> Tensor:
        """``h (state, ..., d_model)`` for states ``0..n_layers-1`` (or ``0..n_layers``) -> translated."""
        return torch.stack([self.transform(h[i], i) for i in range(h.shape[0])])

    def transform_mid(self, h: Tensor, layer: int) -> Tensor:
        """Translate ``h``, the residual after block ``layer``'s attention (base lens: the identity)."""
        if not 0 <= layer < self.n_layers:
            raise InputError(f"mid-layer state {layer} is outside 0..{self.n_layers - 1}")
        return h

    def logits(self, h: Tensor, layer: int) -> Tensor:
        return decode(self._anatomy, self.transform(h, layer))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer <= self.n_layers:
            raise InputError(f"layer {layer} is outside 0..{self.n_layers}")

    def extra_repr(self) -> str:
        return f"model={self.model_name!r}, n_layers={self.n_layers}, d_model={self.d_model}, mid={self.mid}"


class LogitLens(Lens):
    """Decode each state directly (nostalgebraist 2020)."""

    kind = "logit"

    def transform(self, h: Tensor, layer: int) -> Tensor:
        self._check_layer(layer)
        return h

    def transform_all(self, h: Tensor) -> Tensor:
        return h


class TunedLens(Lens):
    """One affine translator per state: ``h + h @ A[l] + b[l]`` (identity at initialisation).

    Parameters: ``A (state, d_model, d_model)``, ``b (state, d_model)`` for states ``0..n_layers-1``;
    the output state ``n_layers`` is left as it is. With ``mid_translators=True`` also ``A_mid (layer, d_model,
    d_model)``, ``b_mid (layer, d_model)`` for the residual after each block's attention (else both are None).

    ``mid=True`` is the older form of a lens trained on mid-layer states only: its ``A, b`` apply to the mid
    states and the regular states are read with the identity.
    """

    kind = "tuned"

    def __init__(self, anatomy: Anatomy, model_name: str = "", mid: bool = False, training: dict | None = None,
                 mid_translators: bool = False):
        super().__init__(anatomy, model_name, mid)
        d, L = anatomy.d_model, anatomy.n_layers
        self.A = nn.Parameter(torch.zeros(L, d, d))
        self.b = nn.Parameter(torch.zeros(L, d))
        if mid_translators and mid:
            raise InputError("a lens has either mid-layer translators besides the regular ones, or (mid=True) "
                             "translators for the mid-layer states only, not both")
        self.A_mid = nn.Parameter(torch.zeros(L, d, d)) if mid_translators else None
        self.b_mid = nn.Parameter(torch.zeros(L, d)) if mid_translators else None
        self.training_info: dict = dict(training or {})

    @property
    def has_mid_translators(self) -> bool:
        """Whether the lens translates the mid-layer (after-attention) states too."""
        return self.A_mid is not None

    def transform_mid(self, h: Tensor, layer: int) -> Tensor:
        """Translate ``h``, the residual after block ``layer``'s attention (the identity if the lens has no
        translator for it)."""
        if not 0 <= layer < self.n_layers:
            raise InputError(f"mid-layer state {layer} is outside 0..{self.n_layers - 1}")
        if self.A_mid is not None:
            return h + h @ self.A_mid[layer].to(h.dtype) + self.b_mid[layer].to(h.dtype)
        if self.mid:
            return h + h @ self.A[layer].to(h.dtype) + self.b[layer].to(h.dtype)
        return h

    def transform(self, h: Tensor, layer: int) -> Tensor:
        self._check_layer(layer)
        if layer == self.n_layers:
            return h
        return h + h @ self.A[layer].to(h.dtype) + self.b[layer].to(h.dtype)

    def transform_all(self, h: Tensor) -> Tensor:
        n = min(h.shape[0], self.n_layers)
        A, b = self.A[:n].to(h.dtype), self.b[:n].to(h.dtype)
        flat = h[:n].reshape(n, -1, h.shape[-1])
        out = (flat + torch.bmm(flat, A) + b[:, None, :]).reshape(h[:n].shape)
        return torch.cat([out, h[n:]]) if h.shape[0] > n else out

    # ------------------------------------------------------------------ files

    def config(self) -> dict:
        A = self._anatomy
        return {
            "lenscope_lens": LENS_FORMAT, "kind": self.kind, "model": self.model_name, "family": A.family,
            "model_type": A.model_type, "fingerprint": fingerprint(A), "n_layers": self.n_layers,
            "d_model": self.d_model, "vocab_size": A.vocab_size, "mid": self.mid,
            "mid_translators": self.has_mid_translators, "training": self.training_info,
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``params.safetensors`` into ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        params = {"A": self.A.detach().contiguous(), "b": self.b.detach().contiguous()}
        if self.has_mid_translators:  # extra keys: lenses without them (and older readers) ignore these
            params.update({"A_mid": self.A_mid.detach().contiguous(), "b_mid": self.b_mid.detach().contiguous()})
        save_file(params, str(directory / "params.safetensors"))
        (directory / "config.json").write_text(json.dumps(self.config(), indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, lm: LoadedModel, *, check_model: bool = True) -> TunedLens:
        """Load a lens saved by lenscope, or by the tuned-lens library (``config.json`` + ``params.pt``)."""
        from .files import load_lens_dir

        return load_lens_dir(directory, lm, check_model=check_model)
