"""The one place where model families are known.

Each module in this package defines ``FAMILY``: a :class:`Family` that reads a transformers model
into an :class:`~lenscope.models.weights.anatomy.Anatomy`, tells the tracer which modules to hook, and
builds the small random configs used by ``tiny:<name>`` models. Adding a family is adding a module
here (it is discovered automatically) plus its test.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ...errors import UnsupportedModelError
from ..weights.anatomy import MLP, Anatomy, Norm, Rotary
from ..weights.moe import MoE


@dataclass
class LayerHooks:
    """Modules of one block whose inputs/outputs the tracer captures.

    - ``block``: input = residual before the block, output = residual after it
    - ``attn``: the attention module; its output's element ``pattern_index`` (default the second; T5's: the last)
      = probabilities (head, q, k)
    - ``attn_out``: output = what attention computed (after the output projection, with its bias)
    - ``mlp_out``: output = what the MLP computed (after the down projection, with its bias)
    - ``act``: input = pre-activation of the (activated branch of the) MLP
    - ``up``: output = the linear branch of a gated MLP
    - ``norms``: slot name (as in :meth:`Layer.norms`) -> norm module (input and output captured)
    - ``q``, ``k``, ``v``: the query, key and value projections (output = per-head q/k/v, heads concatenated), or
    - ``qkv``: one fused projection, its output laid out as ``qkv_layout``: ``"blocks"`` (``[q | k | v]``, each the
      heads in order: GPT-2; Phi-3 with fewer key/value heads) or ``"grouped"`` (per key/value head its query heads
      then its key and value, ``[q_1 .. q_g k v]``, each ``d_head``: Falcon, multi-query attention being one group;
      GPT-NeoX and BLOOM, one query head per group: per head ``[q k v]``)
    - ``up_fused``: ``up``'s output holds both branches of the gated MLP, ``[gate | up]`` (Phi-3's
      ``gate_up_proj``): the site ``mlp_up`` is its second half
    - ``readers``: slot -> the sub-layer module whose first input is the slot's output, where that is not the norm
      module's own output: (1) a slot without a norm module (not in ``norms``; the Anatomy's norm is the identity,
      OLMo 2's pre-norms): its input, scale and output are the reader's input; (2) ``ln_mlp`` of a parallel block
      whose attention and MLP share one norm (GPT-J, Cohere, Falcon, StableLM), named under both slots: the engine
      gives the MLP its own copy (the real norm module run again on the block's input), so that an edit or a
      gradient at ``ln_mlp`` reaches only the MLP and one at ``ln_attn`` only the attention, as for two norms with
      the same weights.
    - mixture-of-experts blocks (:class:`~lenscope.models.weights.moe.MoE`): ``router``: output = ``(router logits,
      the chosen experts' weights, their indices)``; ``experts``: input = ``(hidden states, expert indices, expert
      weights)``, output = the weighted sum of the experts' outputs; ``mlp_out`` is then the whole block and
      ``act``, ``up`` are not used (the engine computes the experts' units with the Anatomy's math)
    - an encoder-decoder model's decoder blocks (docs/encoder-decoder.md): ``cross``: the cross-attention module,
      its output's element ``pattern_index`` = probabilities (head, q, src); ``cross_out``: output =
      what cross-attention computed (input = its per-head outputs); ``cross_q``, ``cross_k``, ``cross_v``: its
      projections (keys and values over the source positions); its norm is the slot ``ln_cross`` of ``norms``
    """

    block: nn.Module
    attn: nn.Module
    attn_out: nn.Module
    mlp_out: nn.Module
    act: nn.Module
    norms: dict[str, nn.Module]
    up: nn.Module | None = None
    q: nn.Module | None = None
    k: nn.Module | None = None
    v: nn.Module | None = None
    qkv: nn.Module | None = None
    qkv_layout: str = "blocks"
    pattern_index: int = 1
    up_fused: bool = False
    readers: dict[str, nn.Module] = field(default_factory=dict)
    router: nn.Module | None = None
    experts: nn.Module | None = None
    cross: nn.Module | None = None
    cross_out: nn.Module | None = None
    cross_q: nn.Module | None = None
    cross_k: nn.Module | None = None
    cross_v: nn.Module | None = None


@dataclass
class ModelHooks:
    layers: list[LayerHooks]
    final_norm: nn.Module | None
    encoder: ModelHooks | None = None  # an encoder-decoder model's encoder stack (``layers``: the decoder's)

    @classmethod
    def of(cls, blocks, final_norm: nn.Module | None, *, norms: dict[str, str], qkv_layout: str = "blocks",
           pattern_index: int = 1,
           up_fused: bool = False, readers: dict[str, str] | None = None, **paths: str) -> ModelHooks:
        """The hooks of every block in ``blocks``, each module given by its dotted path inside a block
        (``attn="self_attn", attn_out="self_attn.o_proj", norms={"ln_attn": "input_layernorm"}, ...``)."""

        def at(block, path: str) -> nn.Module:
            mod = block
            for name in path.split("."):
                mod = getattr(mod, name, None)
                if mod is None:
                    raise UnsupportedModelError(
                        f"{type(block).__name__} has no module {path!r}, where lenscope hooks this family; this "
                        "variant of the model is not supported")
            return mod

        layers = [LayerHooks(block=b, norms={slot: at(b, p) for slot, p in norms.items()}, qkv_layout=qkv_layout,
                             pattern_index=pattern_index,
                             up_fused=up_fused, readers={slot: at(b, p) for slot, p in (readers or {}).items()},
                             **{k: at(b, p) for k, p in paths.items()}) for b in blocks]
        return cls(layers=layers, final_norm=final_norm)


@dataclass
class Family:
    """What lenscope knows about one architecture family."""

    name: str
    model_types: tuple[str, ...]
    read: Callable[[nn.Module], Anatomy]
    hooks: Callable[[nn.Module], ModelHooks]
    tiny: dict[str, Callable[[dict], object]] = field(default_factory=dict)
    encoder: bool = False  # an encoder-only model (BERT, RoBERTa)
    encoder_decoder: bool = False  # an encoder and a decoder with cross-attention (T5, BART, mBART, M2M-100, ...)
    notes: str = ""

    @property
    def kind(self) -> str:
        """``"encoder"``, ``"encoder-decoder"`` or ``"decoder"``."""
        return "encoder-decoder" if self.encoder_decoder else "encoder" if self.encoder else "decoder"


# ----------------------------------------------------------------------------------------------
# helpers shared by family modules

# where the q/k/v projections and a gated MLP sit in the transformers blocks that have them (ModelHooks.of paths)
SEPARATE_QKV = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj"}
PRE_NORMS = {"ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm"}  # Llama, GPT-NeoX, BLOOM
GATED_SITES = {"attn": "self_attn", "attn_out": "self_attn.o_proj", "mlp_out": "mlp.down_proj", "act": "mlp.act_fn",
               "up": "mlp.up_proj", **SEPARATE_QKV}


def t(p: Tensor | None) -> Tensor | None:
    """Detached parameter (no copy)."""
    return None if p is None else p.detach()


def linear_in_out(lin: nn.Module) -> Tensor:
    """An ``nn.Linear``'s weight as (in, out), for ``x @ W``."""
    return lin.weight.detach().T


def split_heads_in(W: Tensor, n_heads: int) -> Tensor:
    """(d_model, n_heads * d_head) -> (n_heads, d_model, d_head)."""
    d_model = W.shape[0]
    return W.reshape(d_model, n_heads, -1).permute(1, 0, 2)


def split_heads_out(W: Tensor, n_heads: int) -> Tensor:
    """(n_heads * d_head, d_model) -> (n_heads, d_head, d_model)."""
    return W.reshape(n_heads, -1, W.shape[-1])


def split_bias(b: Tensor | None, n_heads: int) -> Tensor | None:
    return None if b is None else b.detach().reshape(n_heads, -1)


def separate_qkv(q: nn.Module, k: nn.Module, v: nn.Module, o: nn.Module, n_heads: int, n_kv_heads: int) -> dict:
    """An :class:`~lenscope.models.weights.anatomy.Attention`'s weights from separate q, k, v and output ``nn.Linear``
    modules, as its keyword arguments: ``W_Q (head, d_model, d_head)``, ``W_K, W_V (kv_head, d_model, d_head)``,
    ``W_O (head, d_head, d_model)``, ``b_Q (head, d_head)``, ``b_K, b_V (kv_head, d_head)``, ``b_O (d_model,)``
    (a bias is None where the module has none)."""
    return dict(
        W_Q=split_heads_in(linear_in_out(q), n_heads), W_K=split_heads_in(linear_in_out(k), n_kv_heads),
        W_V=split_heads_in(linear_in_out(v), n_kv_heads), W_O=split_heads_out(linear_in_out(o), n_heads),
        b_Q=split_bias(q.bias, n_heads), b_K=split_bias(k.bias, n_kv_heads), b_V=split_bias(v.bias, n_kv_heads),
        b_O=t(o.bias),
    )


def gated_mlp(m: nn.Module, act: str) -> MLP:
    """The MLP ``down(act(gate(x)) * up(x))`` of a module with ``up_proj``, ``gate_proj`` and ``down_proj``:
    ``W_in, W_gate (d_model, d_mlp)``, ``W_out (d_mlp, d_model)``."""
    return MLP(W_in=linear_in_out(m.up_proj), b_in=t(m.up_proj.bias), W_gate=linear_in_out(m.gate_proj),
               b_gate=t(m.gate_proj.bias), W_out=linear_in_out(m.down_proj), b_out=t(m.down_proj.bias), act=act)


def stacked_experts(ex: nn.Module, act: str, *, interleaved: bool = False, transposed: bool = False, **kw) -> MLP:
    """The experts of a transformers MoE block as one :class:`MLP` with a leading expert axis (views): from
    ``gate_up_proj`` (``(expert, 2 d_mlp, d_model)``, gate rows first; ``transposed``: ``(expert, d_model, 2 d_mlp)``;
    ``interleaved``: gate and up alternate, GPT-OSS), ``down_proj`` (``(expert, d_model, d_mlp)``; transposed:
    ``(expert, d_mlp, d_model)``) and their biases where present; ``kw``: the MLP's activation settings."""
    gu = ex.gate_up_proj.detach()
    gu = gu if transposed else gu.transpose(1, 2)  # (expert, d_model, 2 d_mlp)
    m = gu.shape[-1] // 2
    gate, up = (gu[..., ::2], gu[..., 1::2]) if interleaved else (gu[..., :m], gu[..., m:])
    b = getattr(ex, "gate_up_proj_bias", None)
    b = None if b is None else b.detach()
    if b is None:
        b_gate = b_up = None
    else:
        b_gate, b_up = (b[..., ::2], b[..., 1::2]) if interleaved else (b[..., :m], b[..., m:])
    down = ex.down_proj.detach()
    return MLP(W_in=up, b_in=b_up, W_gate=gate, b_gate=b_gate, W_out=down if transposed else down.transpose(1, 2),
               b_out=t(getattr(ex, "down_proj_bias", None)), act=act, **kw)


def moe_block(router: nn.Module, experts: MLP, top_k: int, **kw) -> MoE:
    """An :class:`~lenscope.models.weights.moe.MoE` from a router module (``weight (expert, d_model)``, optional
    ``bias``) and its experts; ``kw``: how the routing weights are formed (``softmax_first``, ``renormalize``)."""
    require(experts.W_in.shape[0] == router.weight.shape[0],
            f"the router scores {router.weight.shape[0]} experts but the block holds {experts.W_in.shape[0]}")
    require(1 <= top_k <= router.weight.shape[0], f"top_k={top_k} is not between 1 and the number of experts")
    return MoE(W_router=linear_in_out(router), b_router=t(getattr(router, "bias", None)), experts=experts,
               top_k=int(top_k), **kw)


def tiny_tokens(tok: dict) -> dict:
    """A tiny config's vocabulary size and special token ids (``tok``: the tiny tokenizer's ``vocab_size``,
    ``bos``, ``eos``, ``pad``), as config keyword arguments."""
    return dict(vocab_size=tok["vocab_size"], bos_token_id=tok["bos"], eos_token_id=tok["eos"],
                pad_token_id=tok["pad"])


def layer_norm(mod: nn.Module) -> Norm:
    """A ``torch.nn.LayerNorm`` (or an equivalent with ``weight``, ``bias``, ``eps``)."""
    eps = getattr(mod, "eps", None)
    if eps is None:
        eps = mod.variance_epsilon
    return Norm("layernorm", t(getattr(mod, "weight", None)), t(getattr(mod, "bias", None)), float(eps))


def rms_norm(mod: nn.Module, *, offset: float = 0.0) -> Norm:
    """An RMSNorm; ``offset=1`` for Gemma's ``(1 + weight)`` convention."""
    eps = getattr(mod, "variance_epsilon", None)
    if eps is None:
        eps = mod.eps
    w = mod.weight.detach()
    if offset:
        w = w.float() + offset
    return Norm("rmsnorm", w, None, float(eps))


def rotary(rot_module: nn.Module, prefix: str = "") -> Rotary:
    """Rotary settings from a transformers rotary-embedding module: its frequencies ``inv_freq`` and the factor
    ``attention_scaling`` of cos and sin, as the module computed them, so scaled RoPE (``linear``, ``llama3``,
    ``yarn``, ``longrope``, ...) is read exactly; the rotated dimension is ``2 * len(inv_freq)`` (partial rotary).
    The ``dynamic`` and ``longrope`` types change their frequencies for inputs longer than a length that
    :func:`rope_context` makes the model's context, so within it the frequencies read here are the ones used."""
    inv_freq = getattr(rot_module, f"{prefix}original_inv_freq", None)  # never updated in place by a forward pass
    if inv_freq is None:
        inv_freq = getattr(rot_module, f"{prefix}inv_freq")
    inv_freq = inv_freq.detach().float()
    scaling = getattr(rot_module, f"{prefix}attention_scaling", 1.0)
    return Rotary(inv_freq=inv_freq, dim=2 * inv_freq.shape[0], attention_scaling=float(scaling))


def rope_context(cfg, rot_module: nn.Module | None = None) -> int:
    """The longest input lenscope runs a rotary model on (``Anatomy.n_ctx``): ``max_position_embeddings``, or for
    LongRoPE (Phi-3's long-context models) its ``original_max_position_embeddings``: beyond it transformers switches
    the whole sequence to other frequencies, a choice by input length that recomputing a prefix of it cannot see.
    (Dynamic NTK changes its frequencies only beyond ``max_position_embeddings``.)"""
    n = cfg.max_position_embeddings
    kind = getattr(rot_module, "rope_type", None)
    kinds = kind.values() if isinstance(kind, dict) else [kind]
    if "longrope" in kinds:
        params = cfg.rope_parameters
        params = [params] if "rope_type" in params else list(params.values())
        n = min([n] + [p["original_max_position_embeddings"] for p in params
                       if p.get("rope_type") == "longrope" and p.get("original_max_position_embeddings")])
    return int(n)


def require(cond: bool, what: str) -> None:
    if not cond:
        raise UnsupportedModelError(what)


# ----------------------------------------------------------------------------------------------
# registry


def _discover() -> dict[str, Family]:
    out: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        fam = getattr(mod, "FAMILY", None)
        if isinstance(fam, Family):
            out[fam.name] = fam
    return out


_FAMILIES: dict[str, Family] | None = None


def families() -> dict[str, Family]:
    """All families by name."""
    global _FAMILIES
    if _FAMILIES is None:
        _FAMILIES = _discover()
    return _FAMILIES


def tiny_names() -> dict[str, Family]:
    """``tiny:<name>`` names -> family."""
    return {name: fam for fam in families().values() for name in fam.tiny}


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` lenscope reads, sorted."""
    return sorted(m for f in families().values() for m in f.model_types)


def family_for(model_or_config) -> Family:
    """The family of a transformers model or config (by ``config.model_type``)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    mt = getattr(cfg, "model_type", None)
    for fam in families().values():
        if mt in fam.model_types:
            return fam
    archs = ", ".join(getattr(cfg, "architectures", None) or [])
    what = f"model type {mt!r}" + (f" ({archs})" if archs else "")
    raise UnsupportedModelError(
        f"{what} is not supported; supported model types: {', '.join(supported_model_types())} "
        "(`lenscope models` lists what each family reads)"
    )


def read_anatomy(model: nn.Module) -> tuple[Family, Anatomy]:
    """The family of a transformers model and its Anatomy, after checking that the engine finds every module it
    hooks. A variant the family's reader does not know (a module or config field it did not find) is an
    :class:`UnsupportedModelError` naming it, never a traceback."""
    fam = family_for(model)
    mt = getattr(model.config, "model_type", None)
    try:
        anatomy = fam.read(model)
        fam.hooks(model)
    except (AttributeError, KeyError, TypeError) as e:
        raise UnsupportedModelError(
            f"lenscope's {fam.name} reader cannot read this {mt!r} model ({type(e).__name__}: {e}); this variant "
            f"is not supported"
        ) from None
    return fam, anatomy


def family_rows() -> list[dict]:
    """One row per family: its name, the model types it reads, and what it supports (:func:`summarize`),
    read from the Anatomies of its ``tiny:`` models (every list the union over them). ``lenscope models`` prints
    these rows."""
    from ..loading.load import load
    from ..loading.summary import summarize

    rows = []
    for fam in sorted(families().values(), key=lambda f: f.name):
        sums = [summarize(load(f"tiny:{name}").anatomy) for name in sorted(fam.tiny)]
        row = {"family": fam.name, "model_types": list(fam.model_types),
               "tiny": [f"tiny:{n}" for n in sorted(fam.tiny)], "kind": fam.kind}
        for key in ("block", "norms", "attention", "mlp", "head"):
            row[key] = list(dict.fromkeys(x for s in sums for x in s[key]))
        row["parallel"] = any(s["parallel"] for s in sums)
        row["moe"] = any(s["moe"] for s in sums)
        rows.append(row)
    return rows


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give a freshly initialised tiny model non-trivial norms and biases (so tests can catch a
    mishandled weight or bias), deterministically (a mixture of experts' stacked expert biases, ``*_bias``, too)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        # per-head norm weights too (Cohere's q/k norms), and stacked expert biases
        if p.ndim == 1 or name.endswith("_bias") or name.endswith("norm.weight"):
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model
