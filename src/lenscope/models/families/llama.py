"""Llama-style decoders: Llama, SmolLM2, Mistral, Qwen2, Qwen3 — RMSNorm, rotary, grouped-query
attention, SwiGLU, optional q/k/v biases (Qwen2), q/k norms (Qwen3) and sliding windows.

This module's reader is the one for every decoder of the Llama layout (a block with ``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``, the rotary embedding on
``model.rotary_emb``): a :class:`Layout` says what the module names alone do not (the norm kind, norms on the
sub-layers' outputs instead of their inputs, constant multipliers); the rest is read from the modules and the
config where the model keeps it — biases, q/k norms (per head, or over the whole projection), fused ``qkv_proj`` /
``gate_up_proj`` (Phi-3), layers without rotary (SmolLM3's ``use_rope``), partial rotary (the rotary module's
frequencies), sliding windows, attention sinks (GPT-OSS), parallel residual (``use_parallel_residual``, or a block
without ``post_attention_layernorm``: Cohere), a plain MLP ``c_fc -> act -> c_proj`` (StarCoder2), a head bias.
Other families' modules declare a :class:`Layout` and their model types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, Norm, Unembed, activation_name
from ..weights.moe import MoE
from . import (
    SEPARATE_QKV,
    Family,
    ModelHooks,
    gated_mlp,
    layer_norm,
    linear_in_out,
    require,
    rms_norm,
    rope_context,
    rotary,
    separate_qkv,
    split_heads_in,
    split_heads_out,
    t,
    tiny_tokens,
)


def layer_window(cfg, i: int) -> int | None:
    """Sliding window of layer ``i`` (None = full attention), as transformers decides it."""
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if types is not None:
        return window if types[i] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return window


@dataclass(frozen=True)
class Scales:
    """Constant multipliers of a Llama-layout model (Granite's): the token embedding's, what each sub-layer adds
    to the residual stream, the attention scores' (instead of ``d_head ** -0.5``) and the logits' (the head's
    ``Unembed.logit_scale``)."""

    embed: float = 1.0
    residual: float = 1.0
    attention: float | None = None
    logits: float = 1.0


@dataclass(frozen=True)
class Layout:
    """How a decoder of the Llama layout differs from Llama where its module names do not say it (every default is
    Llama's).

    - ``norm``: the kind of every norm, ``"rmsnorm"`` or ``"layernorm"`` (StableLM);
    - ``norms_after``: the block's norms act on the sub-layers' outputs and the sub-layers read the residual stream
      itself (OLMo 2: ``post_attention_layernorm`` and ``post_feedforward_layernorm``; the pre-norm slots are the
      identity);
    - ``scales``: the config's constant multipliers (:class:`Scales`), when it has any (Granite, Cohere);
    - ``rotate_pairs``: the rotary embedding rotates adjacent pairs (rotate-every-two: Cohere);
    - ``moe``: the mixture-of-experts block of a decoder layer, ``moe(cfg, block)``, in place of a dense MLP
      (Mixtral, OLMoE, GPT-OSS); its hooks are the block ``mlp``, its ``experts`` and its router (``mlp.router``
      where the block has one, else ``mlp.gate``);
    - ``check``: refuses, with a one-line :func:`require`, the config switches lenscope does not model.
    """

    family: str = "llama"
    norm: str = "rmsnorm"
    norms_after: bool = False
    scales: Callable[[object], Scales] | None = None
    rotate_pairs: bool = False
    moe: Callable[[object, nn.Module], MoE] | None = None
    check: Callable[[object], None] | None = None

    # -------------------------------------------------------------------------------------- reading

    def _norm(self, mod: nn.Module) -> Norm:
        return layer_norm(mod) if self.norm == "layernorm" else rms_norm(mod)

    def _qk_norm(self, a: nn.Module, which: str, n_heads: int, d_head: int) -> tuple[Norm | None, bool | None]:
        """The q or k norm of attention module ``a`` and whether it acts across heads
        (:attr:`Attention.qk_norm_across_heads`): one norm over each head (False: Qwen3), one per head (False,
        weight ``(head, 1, d_head)``: StableLM's ``q_layernorm``), one over the whole projection (True: OLMo 2), or
        either (None: no norm, or a projection of one head)."""
        mod = getattr(a, f"{which}_norm", None)
        mod = getattr(a, f"{which}_layernorm", None) if mod is None else mod
        if mod is None:
            return None, None
        per_head = getattr(mod, "norms", None)
        if per_head is not None:  # one LayerNorm per head
            norms = [self._norm(m) for m in per_head]
            require(len(norms) == n_heads, f"{which} norm: {len(norms)} per-head norms for {n_heads} heads")
            w = None if norms[0].weight is None else torch.stack([n.weight for n in norms])[:, None, :]
            b = None if norms[0].bias is None else torch.stack([n.bias for n in norms])[:, None, :]
            return Norm(norms[0].kind, w, b, norms[0].eps), False
        norm = self._norm(mod)
        if norm.weight is not None and norm.weight.dim() == 2:  # one weight per head (head, d_head): Cohere
            return dataclasses.replace(norm, weight=norm.weight.unsqueeze(-2)), False
        d = norm.weight.shape[-1] if norm.weight is not None else d_head
        if d == d_head:
            return norm, None if n_heads == 1 else False
        require(d == n_heads * d_head, f"a {which} norm over {d} features fits neither one head ({d_head}) nor the "
                                       f"whole projection ({n_heads} x {d_head}); this variant is not supported")
        return norm, True

    def _attention(self, cfg, a: nn.Module, i: int, rot, H: int, KV: int, dh: int, scale: float) -> Attention:
        if hasattr(a, "qkv_proj"):  # fused [q | k | v] (Phi-3)
            W = linear_in_out(a.qkv_proj)
            b = t(a.qkv_proj.bias)
            sizes = [H * dh, KV * dh, KV * dh]
            Wq, Wk, Wv = W.split(sizes, dim=1)
            bq, bk, bv = (None, None, None) if b is None else b.split(sizes)
            proj = dict(W_Q=split_heads_in(Wq, H), W_K=split_heads_in(Wk, KV), W_V=split_heads_in(Wv, KV),
                        W_O=split_heads_out(linear_in_out(a.o_proj), H),
                        b_Q=None if bq is None else bq.reshape(H, dh), b_K=None if bk is None else bk.reshape(KV, dh),
                        b_V=None if bv is None else bv.reshape(KV, dh), b_O=t(a.o_proj.bias))
        else:
            proj = separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.o_proj, H, KV)
        q_norm, q_across = self._qk_norm(a, "q", H, dh)
        k_norm, k_across = self._qk_norm(a, "k", KV, dh)
        scopes = {s for s in (q_across, k_across) if s is not None}
        require(len(scopes) <= 1, "q and k norms of different scopes (one per head, one over the whole projection) "
                                  "are not supported")
        return Attention(
            **proj, scale=scale, rotary=rot if getattr(a, "use_rope", True) else None,
            q_norm=q_norm, k_norm=k_norm, qk_norm_across_heads=bool(scopes) and scopes.pop(),
            window=layer_window(cfg, i), sinks=t(getattr(a, "sinks", None)),
        )

    def _mlp(self, cfg, blk: nn.Module) -> MLP | MoE:
        if self.moe is not None:
            return self.moe(cfg, blk)
        m = blk.mlp
        act = activation_name(cfg.hidden_act)
        if hasattr(m, "c_fc"):  # plain c_fc -> act -> c_proj (StarCoder2)
            return MLP(W_in=linear_in_out(m.c_fc), b_in=t(m.c_fc.bias), W_out=linear_in_out(m.c_proj),
                       b_out=t(m.c_proj.bias), act=act)
        if hasattr(m, "gate_up_proj"):  # fused [gate | up] (Phi-3)
            W = linear_in_out(m.gate_up_proj)
            b = t(m.gate_up_proj.bias)
            W_gate, W_in = W.chunk(2, dim=1)
            b_gate, b_in = (None, None) if b is None else b.chunk(2)
            return MLP(W_in=W_in, b_in=b_in, W_gate=W_gate, b_gate=b_gate, W_out=linear_in_out(m.down_proj),
                       b_out=t(m.down_proj.bias), act=act)
        return gated_mlp(m, act)

    def _layer(self, cfg, blk: nn.Module, attn: Attention, mlp: MLP, residual: float) -> Layer:
        if self.norms_after:
            w = blk.post_attention_layernorm.weight
            identity = Norm("identity", w.new_ones(w.shape).detach(), None, 0.0)
            return Layer("sandwich", attn, mlp, ln_attn=identity, ln_mlp=identity,
                         ln_attn_out=self._norm(blk.post_attention_layernorm),
                         ln_mlp_out=self._norm(blk.post_feedforward_layernorm), residual_scale=residual)
        ln_attn = self._norm(blk.input_layernorm)
        if _parallel(blk):  # both sub-layers read input_layernorm's output
            return Layer("parallel", attn, mlp, ln_attn=ln_attn, ln_mlp=ln_attn, residual_scale=residual)
        return Layer("pre", attn, mlp, ln_attn=ln_attn, ln_mlp=self._norm(blk.post_attention_layernorm),
                     residual_scale=residual)

    def read(self, model) -> Anatomy:
        cfg = model.config
        base = model.model
        if self.check is not None:
            self.check(cfg)
        d, H, KV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        dh = getattr(cfg, "head_dim", None) or d // H
        sc = self.scales(cfg) if self.scales is not None else Scales()
        rot_mod = base.rotary_emb
        if isinstance(getattr(rot_mod, "rope_type", None), dict):  # one rotary per layer type (OLMo 3)
            rots = {kind: rotary(rot_mod, prefix=f"{kind}_") for kind in set(cfg.layer_types)}
            rot = [rots[kind] for kind in cfg.layer_types]
        else:
            rot = [rotary(rot_mod)] * len(base.layers)
        if self.rotate_pairs:
            rot = [dataclasses.replace(r, interleaved=True) for r in rot]
        scale = dh**-0.5 if sc.attention is None else float(sc.attention)
        layers = [self._layer(cfg, blk, self._attention(cfg, blk.self_attn, i, rot[i], H, KV, dh, scale),
                              self._mlp(cfg, blk), float(sc.residual)) for i, blk in enumerate(base.layers)]
        return Anatomy(
            family=self.family, model_type=cfg.model_type, d_model=d, n_ctx=rope_context(cfg, base.rotary_emb),
            vocab_size=cfg.vocab_size, embed=Embedding(W_E=base.embed_tokens.weight.detach(), scale=float(sc.embed)),
            layers=layers, final_norm=self._norm(base.norm),
            unembed=Unembed(W_U=linear_in_out(model.lm_head), b_U=t(model.lm_head.bias), logit_scale=float(sc.logits)),
        )

    # ---------------------------------------------------------------------------------------- hooks

    def hooks(self, model) -> ModelHooks:
        base = model.model
        blk, a, m = base.layers[0], base.layers[0].self_attn, base.layers[0].mlp
        paths: dict = {"attn": "self_attn", "attn_out": "self_attn.o_proj"}
        paths.update({"qkv": "self_attn.qkv_proj"} if hasattr(a, "qkv_proj") else SEPARATE_QKV)
        if self.moe is not None:
            paths.update(mlp_out="mlp", act="mlp.experts", experts="mlp.experts",
                         router="mlp.router" if hasattr(m, "router") else "mlp.gate")
        elif hasattr(m, "c_fc"):
            paths.update(mlp_out="mlp.c_proj", act="mlp.act")
        else:
            paths.update(mlp_out="mlp.down_proj",
                         act="mlp.activation_fn" if hasattr(m, "activation_fn") else "mlp.act_fn")
            if hasattr(m, "gate_up_proj"):
                paths.update(up="mlp.gate_up_proj", up_fused=True)
            else:
                paths["up"] = "mlp.up_proj"
        if self.norms_after:
            paths.update(norms={"ln_attn_out": "post_attention_layernorm", "ln_mlp_out": "post_feedforward_layernorm"},
                         readers={"ln_attn": "self_attn", "ln_mlp": "mlp"})
        elif _parallel(blk):  # one norm, read by both sub-layers (the MLP: a copy)
            paths.update(norms={"ln_attn": "input_layernorm", "ln_mlp": "input_layernorm"}, readers={"ln_mlp": "mlp"})
        else:
            paths["norms"] = {"ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm"}
        return ModelHooks.of(base.layers, base.norm, **paths)


def _parallel(blk: nn.Module) -> bool:
    """Whether attention and the MLP both read ``input_layernorm``'s output (GPT-NeoX-style ``use_parallel_residual``;
    Cohere's blocks, which have no second norm)."""
    return getattr(blk, "use_parallel_residual", False) or not hasattr(blk, "post_attention_layernorm")


LLAMA = Layout()
read = LLAMA.read
hooks = LLAMA.hooks


def _tiny_llama(tok: dict, **kw):
    from transformers import LlamaConfig

    kw.setdefault("rope_theta", 10000.0)
    return LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False,
                       **tiny_tokens(tok), **kw)


def _tiny_qwen2(tok: dict):
    from transformers import Qwen2Config

    return Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=True,
                       **tiny_tokens(tok))


def _tiny_llama_rope_llama3(tok: dict):
    """Llama 3.1's rope scaling (``llama3``), with an original context short enough that most frequencies are
    rescaled."""
    return _tiny_llama(tok, rope_theta=None, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})


def _tiny_qwen3_yarn(tok: dict):
    """Qwen3 (q/k norms) with YaRN rope scaling, whose ``attention_scaling`` multiplies cos and sin."""
    from transformers import Qwen3Config

    return Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 32}, **tiny_tokens(tok))


FAMILY = Family(
    name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"), read=read, hooks=hooks,
    tiny={"llama": _tiny_llama, "qwen2": _tiny_qwen2, "llama-rope-llama3": _tiny_llama_rope_llama3,
          "qwen3-yarn": _tiny_qwen3_yarn},
)
