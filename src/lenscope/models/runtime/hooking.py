"""The hooks the engine puts on a real model (:func:`register`): for each site a session wants, a hook on the module
the family file names (:class:`~lenscope.models.families.LayerHooks`), passing the tensor through the session's
``visit`` (edit, capture, stop). Both stacks of an encoder-decoder model: the decoder's sites by their names, the
encoder's with the prefix ``enc.`` (:data:`~lenscope.models.runtime.sites.ENC`), cross-attention's on the decoder's
blocks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...errors import NotApplicableError, UnsupportedModelError
from ..weights.moe import MOE_SITES
from .sites import CROSS_SITES, ENC, NORM_SLOTS, ROUTER_SITES


def register(s, hooks, handles: list) -> None:
    """Put on the real model the hooks the session ``s`` (the engine's ``_Session``) needs, and only those;
    their handles go to ``handles``."""
    _Hooks(s, handles).add_all(hooks)


class _Hooks:
    """The hooks of one session ``s``: a factory per kind of site (each returns the hook function, which passes the
    tensor through ``s.visit``) and the walk over a stack's blocks that registers them (handles into
    ``handles``)."""

    def __init__(self, s, handles: list):
        self.s, self.handles = s, handles

    def add_all(self, hooks) -> None:
        """Both stacks' hooks: the decoder's (or the only) stack, then an encoder-decoder model's encoder."""
        s = self.s
        self.stack(hooks.layers, hooks.final_norm, "")
        if hooks.encoder is not None:
            self.stack(hooks.encoder.layers, hooks.encoder.final_norm, ENC)
        elif any(name.startswith(ENC) for name, _ in s.wanted()):
            raise NotApplicableError("the sites 'enc.*' exist only in encoder-decoder models (their encoder)")

    # -- hook functions, one factory per kind of site ----------------------------------------------------------

    @staticmethod
    def on_input(fn):  # a pre-hook (with_kwargs) passing the first input (or ``hidden_states``) through ``fn``
        def f(mod, args, kwargs):
            if args:
                return (fn(args[0]),) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        return f

    def pre(self, key, kw=False):
        s = self.s
        if kw:
            return self.on_input(lambda x: s.visit(key, x))

        def g(mod, args):
            return (s.visit(key, args[0]),) + tuple(args[1:])
        return g

    def post(self, key, index=0):
        s = self.s

        def f(mod, args, out):
            if isinstance(out, tuple):
                i = index % len(out)  # -1: the last output (T5's attention: output, position bias, probabilities)
                return out[:i] + (s.visit(key, out[i]),) + out[i + 1:]
            return s.visit(key, out)
        return f

    def fused(self, layer, layout, prefix):
        s = self.s
        keys = [(prefix + n, layer) for n in ("q", "k", "v")]

        def f(mod, args, out):
            if not any(s.wants(k) for k in keys):
                return out
            write = any(k in s.by_site or (s.grad and k in s.capture) for k in keys)
            B, P = s.B, s.P
            H, K = s.n_heads(prefix + "q", layer), s.n_heads(prefix + "k", layer)
            if layout == "blocks":  # [q | k | v], heads in order in each (GPT-2; Phi-3 with fewer key/value heads)
                e = out.shape[-1] // (H + 2 * K)
                parts, dim = out.view(B, P, -1).split([H * e, K * e, K * e], dim=-1), -1
            else:  # "grouped": per key/value head its query heads, key, value ([q_1 .. q_g k v], each d_head)
                parts, dim = out.view(B, P, K, H // K + 2, -1).split([H // K, 1, 1], dim=3), 3
            # the model goes on from the visited parts, put together anew (never written into a captured view: a
            # captured part must stay a node of the graph its gradient is taken through)
            new = [s.visit(k, part.reshape(B, P, -1)).reshape(part.shape) if s.wants(k) else part
                   for k, part in zip(keys, parts)]
            return torch.cat(new, dim=dim).reshape(out.shape) if write else out
        return f

    def router(self, layer):
        s = self.s
        kl, kw = ("router_logits", layer), ("routing_weights", layer)

        def f(mod, args, out):  # out: router logits, the chosen experts' weights, their indices
            if s.wants(kl):
                s.visit(kl, out[0])
            if s.wants(kw):  # dense over the experts: 0 for those not chosen
                s.visit(kw, out[1].new_zeros(out[2].shape[0], out[0].shape[-1]).scatter(1, out[2], out[1]))
            return out
        return f

    def experts(self, layer):
        s = self.s
        keys = {n: (n, layer) for n in MOE_SITES}

        def f(mod, args, out):
            if not any(s.wants(k) for k in keys.values()):
                return out
            if len(args) < 3:
                raise UnsupportedModelError("this mixture-of-experts block passes its experts keyword arguments")
            x, idx, w = args[:3]
            moe = s.lm.anatomy.layers[layer].mlp
            weights = w.new_zeros(idx.shape[0], moe.n_experts).scatter(1, idx, w)

            def visit(name, t):
                return s.visit(keys[name], t) if s.wants(keys[name]) else t

            if any(k in s.by_site for k in keys.values()):  # the edit's change, on the model's own output (with
                total = moe.run(x, weights, visit)  # gradients the unedited path cancels the model's own)
                return out + (total - moe.run(x, weights, lambda name, t: t)).to(out)
            total = moe.run(x.detach(), weights.detach(), visit)  # unedited: captures beside the model's own path
            return out + (total - total.detach()).to(out) if s.grad and any(k in s.capture for k in keys.values()) \
                else out  # with grad=True: the same numbers, and the gradient reaches the captures
        return f

    def second_half(self, key):  # a fused [gate | up] projection (Phi-3): the site is its second half
        s = self.s

        def f(mod, args, out):
            gate, up = out.chunk(2, dim=-1)
            return out if (new := s.visit(key, up)) is up else torch.cat([gate, new], dim=-1)
        return f

    # -- norms, cross-attention and the walk over the blocks ---------------------------------------------------

    def norm(self, slot, layer, mod):  # slot: with its stack's prefix
        s, handles = self.s, self.handles
        kin, kout, kscale = ((f"{slot}.{w}", layer) for w in ("in", "out", "scale"))
        if s.wants(kin):
            handles.append(mod.register_forward_pre_hook(self.pre(kin)))
        if s.wants(kout) or s.wants(kscale):
            def f(mod, args, out):
                if s.wants(kscale):
                    s.visit(kscale, s.norm_scale(slot, layer, args[0]))
                return self.post(kout)(mod, args, out) if s.wants(kout) else out
            handles.append(mod.register_forward_hook(f))

    def absent_norm(self, slot, layer, reader):
        """The sites of a norm slot the block lacks (the Anatomy's identity norm: OLMo 2's pre-norms): its input,
        scale and output are all the input of ``reader``, the sub-layer that reads the slot."""
        s, handles = self.s, self.handles
        kin, kout, kscale = ((f"{slot}.{w}", layer) for w in ("in", "out", "scale"))

        def f(x):
            if s.wants(kin):
                x = s.visit(kin, x)
            if s.wants(kscale):
                s.visit(kscale, s.norm_scale(slot, layer, x))
            return s.visit(kout, x) if s.wants(kout) else x
        if any(s.wants(k) for k in (kin, kout, kscale)):
            handles.append(reader.register_forward_pre_hook(self.on_input(f), with_kwargs=True))

    def shared_norm(self, layer, mod, reader, prefix):
        """The ``ln_mlp`` sites of a norm that attention and the MLP share (``LayerHooks.readers``): the MLP reads
        its own copy, the real norm module run again on the block's input as it entered the norm (before any
        ``ln_attn`` edit), after the ``ln_mlp`` edits."""
        s, handles = self.s, self.handles
        keys = [(f"{prefix}{slot}.{w}", layer) for slot in ("ln_attn", "ln_mlp") for w in ("in", "out", "scale")]
        if not any(s.wants(k) for k in keys):  # the model's own single norm then serves both
            return
        kin, kout, kscale = keys[3:]
        stash: list = []

        def keep_input(mod, args):  # registered before the ln_attn hooks: sees the input they may edit
            stash.append(args[0])

        def mlp_input(_, args):
            x = stash.pop()
            if s.wants(kin):
                x = s.visit(kin, x)
            if s.wants(kscale):
                s.visit(kscale, s.norm_scale(prefix + "ln_mlp", layer, x))
            y = mod.forward(x)  # forward, not __call__: the norm's own hooks are the ln_attn sites
            if s.wants(kout):
                y = s.visit(kout, y)
            return (y,) + tuple(args[1:])

        handles.append(mod.register_forward_pre_hook(keep_input))
        handles.append(reader.register_forward_pre_hook(mlp_input))

    def cross(self, i, lh):  # a decoder block's cross-attention over the encoder's output
        s, handles = self.s, self.handles
        w = lambda name: s.wants((name, i))  # noqa: E731
        if lh.cross is None:
            for n in (n for n in CROSS_SITES if w(n)):
                raise NotApplicableError(f"site {n!r} exists only in the decoder blocks of an encoder-decoder model")
            return
        if w("cross_pattern"):
            handles.append(lh.cross.register_forward_hook(self.post(("cross_pattern", i), index=lh.pattern_index)))
        if w("cross_out"):
            handles.append(lh.cross_out.register_forward_hook(self.post(("cross_out", i))))
        if w("cross_head"):
            handles.append(lh.cross_out.register_forward_pre_hook(self.pre(("cross_head", i))))
        for name, mod in (("cross_q", lh.cross_q), ("cross_k", lh.cross_k), ("cross_v", lh.cross_v)):
            if w(name):
                handles.append(mod.register_forward_hook(self.post((name, i))))

    def stack(self, layers, final_norm, prefix: str) -> None:
        s = self.s
        for i, lh in enumerate(layers):
            if prefix or i >= s.start_at:  # the blocks a run starting later skips have no hooks
                self.block(i, lh, prefix)
        if any(s.wants((prefix + n, None)) for n in ("ln_final.in", "ln_final.out", "ln_final.scale")):
            if final_norm is None:
                raise NotApplicableError(f"this model has no final norm (site {prefix + 'ln_final'!r})")
            self.norm(prefix + "ln_final", None, final_norm)

    def block(self, i, lh, prefix: str) -> None:
        s, handles = self.s, self.handles
        w = lambda name: s.wants((prefix + name, i))  # noqa: E731
        k = lambda name: (prefix + name, i)  # noqa: E731
        if w("resid_pre"):
            handles.append(lh.block.register_forward_pre_hook(self.pre(k("resid_pre"), kw=True), with_kwargs=True))
        if w("resid_post"):
            handles.append(lh.block.register_forward_hook(self.post(k("resid_post"))))
        if w("pattern"):
            handles.append(lh.attn.register_forward_hook(self.post(k("pattern"), index=lh.pattern_index)))
        if w("attn_out"):
            handles.append(lh.attn_out.register_forward_hook(self.post(k("attn_out"))))
        if w("head"):
            handles.append(lh.attn_out.register_forward_pre_hook(self.pre(k("head"))))
        if w("mlp_out"):
            handles.append(lh.mlp_out.register_forward_hook(self.post(k("mlp_out"))))
        if lh.experts is not None:  # a mixture of experts: the MLP sites come from the experts module
            if any(w(n) for n in MOE_SITES):
                handles.append(lh.experts.register_forward_hook(self.experts(i)))
            if any(w(n) for n in ROUTER_SITES):
                handles.append(lh.router.register_forward_hook(self.router(i)))
        else:
            for n in (n for n in ROUTER_SITES + ("expert_out",) if w(n)):
                raise NotApplicableError(f"site {n!r} exists only for mixture-of-experts blocks; block {i} is dense")
            if w("mlp_hidden"):
                handles.append(lh.mlp_out.register_forward_pre_hook(self.pre(k("mlp_hidden"))))
            if w("mlp_pre"):
                handles.append(lh.act.register_forward_pre_hook(self.pre(k("mlp_pre"))))
            if w("mlp_up"):
                if lh.up is None:
                    raise NotApplicableError("site 'mlp_up' exists only for gated MLPs")
                handles.append(lh.up.register_forward_hook(self.second_half(k("mlp_up")) if lh.up_fused
                                                           else self.post(k("mlp_up"))))
        if w("q") or w("k") or w("v"):
            if lh.qkv is not None:
                handles.append(lh.qkv.register_forward_hook(self.fused(i, lh.qkv_layout, prefix)))
            else:
                for name, mod in (("q", lh.q), ("k", lh.k), ("v", lh.v)):
                    if w(name):
                        handles.append(mod.register_forward_hook(self.post(k(name))))
        for slot, mod in lh.norms.items():
            if slot in lh.readers:  # a norm shared with ln_attn: the reader runs its own copy
                self.shared_norm(i, mod, lh.readers[slot], prefix)
        for slot, mod in lh.norms.items():
            if slot not in lh.readers:
                self.norm(prefix + slot, i, mod)
        for slot, reader in lh.readers.items():
            if slot not in lh.norms:
                self.absent_norm(prefix + slot, i, reader)
        for slot in NORM_SLOTS:
            if slot not in {**lh.norms, **lh.readers} and any(w(f"{slot}.{x}") for x in ("in", "out", "scale")):
                raise NotApplicableError(f"this model's blocks have no norm {slot!r}; they have "
                                         f"{', '.join(lh.norms)}")
        if not prefix:
            self.cross(i, lh)


class _Skipped(tuple):
    """What a skipped block returns: its input, in a one-element tuple (a model that reads a block's ``output[0]``
    goes on with the input; one that goes on with the whole output hands the tuple to the next skipped block)."""


def _skip(*args, **kwargs):
    x = args[0] if args else kwargs["hidden_states"]
    return x if isinstance(x, _Skipped) else _Skipped((x,))


@contextmanager
def skipping(hooks, start_at: int, start, device):
    """For the duration: the blocks before ``start_at`` not run (each hands its input on: whatever the model makes
    of it is replaced at block ``start_at``), and the residual stream entering block ``start_at`` replaced by
    ``start (b, p, d_model)`` before any hook of that block sees it. ``start`` None: nothing changes."""
    if start is None:
        yield
        return
    blocks = [lh.block for lh in hooks.layers]

    def enter(mod, args, kwargs):
        x = start.to(device)
        return ((x,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handle = blocks[start_at].register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
    saved = [b.__dict__.get("forward") for b in blocks[:start_at]]  # a wrapper accelerate put there, if any
    try:
        for b in blocks[:start_at]:
            b.forward = _skip
        yield
    finally:
        handle.remove()
        for b, f in zip(blocks[:start_at], saved):
            if f is None:
                del b.forward
            else:
                b.forward = f
