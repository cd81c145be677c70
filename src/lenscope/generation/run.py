"""``lenscope.generate``: generate a continuation and explain every generated token, from one pass.

In a causal decoder the prediction of generated token ``p`` (read at ``p - 1``) sees only tokens ``0..p-1``, so
the states every step's explanation needs are all in one forward pass over the final sequence: a prefix's trace
is the full trace cut short (:func:`lenscope.models.runtime.trace.prefix_trace`), and a prefix's ALTI / value-zeroing
contributions are the top-left block of the full ones. So

- Logit and ALTI-Logit: one trace; the per-step read-out directions go through the logit algebra as the rows of
  one batch (:func:`lenscope.attribution.context.attention_logit_rows`); ALTI's contributions are computed once
  for the whole text and every step's per-layer updates are carried back through them at once
  (:func:`lenscope.attribution.context.alti_logit_rows`);
- ALTI and value zeroing: the rollout rows of every step's read position, from the same contributions;
- the gradient methods: one batch whose rows are the full sequence, each row's objective its own step
  (later tokens do not change it), through :func:`lenscope.attribution.baselines.gradient_rows` /
  :func:`~lenscope.attribution.baselines.integrated_gradients_rows`;
- erasure: one ablated copy of the text per erased source serves every step after it
  (:func:`~lenscope.attribution.baselines.erasure_rows` with one position per row).

Each step's explanation equals ``lenscope.explain(lm, ids[:p], token, foil, method=m)`` up to float error
(tests/generation).

An encoder-decoder (translation) model generates given its source (``source=``): the prompt is the target prefix,
the tokens are transformers' greedy ones, and one teacher-forced trace of the source and the whole decoder sequence
serves every step (its decoder is causal), through the methods that read a source (docs/encoder-decoder.md).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..attribution import context
from ..attribution import methods as table
from ..errors import InputError, NotApplicableError, UnsupportedModelError
from ..lenses.depth import depths_from_agreement
from ..lenses.lenses import Lens, LogitLens
from ..models.loading.load import LoadedModel, require_decoder, token_ids
from ..models.runtime.engine import edits_within
from ..models.runtime.request import Request
from ..models.runtime.trace import source_ids, trace
from ..models.weights.readout import Readout
from .result import Generation, stack_scores

MAX_TOKENS = table.MAX_TOKENS


def _methods(explain) -> list[str]:
    if isinstance(explain, str):
        explain = [m.strip() for m in explain.split(",") if m.strip()]
    out = []
    for m in explain:
        table.get(m, choose="choose from")
        if m not in out:
            out.append(m)
    return out


def _prompt_ids(lm: LoadedModel, prompt, chat: bool) -> Tensor:
    if not chat:
        return token_ids(lm, prompt)
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("--chat needs the user's message as a non-empty text")
    tok = lm.tokenizer
    if not getattr(tok, "chat_template", None):
        raise InputError(f"{lm.name}'s tokenizer has no chat template, so --chat cannot format the prompt; "
                         "leave --chat out (or use an instruction model such as smollm2)")
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=False)
    return token_ids(lm, tok(text, add_special_tokens=False)["input_ids"])


def _eos(lm: LoadedModel):
    cfg = getattr(lm.model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None)
    return eos if eos is not None else lm.tokenizer.eos_token_id


def _edit_list(lm: LoadedModel, edits, prompt_len: int, max_new_tokens: int) -> list | None:
    """``edits`` as a list of the engine's edits (None: none given). A function is called with the prompt's
    length and the longest sequence's (edits that depend on where the prompt ends)."""
    if edits is None:
        return None
    if callable(edits):
        edits = edits(prompt_len, prompt_len + max_new_tokens)
    from ..models.runtime.engine import Edit

    edits = list(edits)
    for e in edits:
        if not isinstance(e, Edit):
            raise InputError(f"edits must be lenscope.models.runtime.engine.Edit objects, not {type(e).__name__}")
        if int(torch.as_tensor(e.rows).max()) > 0:
            raise InputError("a generation is one batch row: its edits take rows=0")
    return edits


@torch.no_grad()
def _decode_edited(lm: LoadedModel, ids: Tensor, max_new_tokens: int, edits: list, eos, sample: bool,
                   seed: int | None, temperature: float) -> Tensor:
    """The decoding loop with the engine's ``edits`` applied at every step: one forward pass per token through
    :func:`lenscope.models.runtime.engine.run` with a key/value cache (each step's edits are the entries at its
    position).
    Greedy takes the arg-max (as transformers does); sampling draws from the softmax at ``temperature`` with a
    generator seeded by ``seed`` (the global random state is untouched)."""
    from ..models.runtime.engine import new_cache, run

    stop = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    gen = None
    if sample:
        gen = torch.Generator()
        gen.manual_seed(int(seed)) if seed is not None else gen.seed()
    cache = new_cache(lm)
    out = ids.tolist()
    x = ids[None]
    for _ in range(int(max_new_tokens)):
        lg = run(lm, x, edits, past=cache, last_only=True).logits[0, -1].float().cpu()
        if sample:
            nxt = int(torch.multinomial(torch.softmax(lg / temperature, -1), 1, generator=gen))
        else:
            nxt = int(lg.argmax())
        out.append(nxt)
        if nxt in stop:
            break
        x = torch.tensor([[nxt]])
    return torch.tensor(out)


@torch.no_grad()
def decode(lm: LoadedModel, ids: Tensor, max_new_tokens: int, *, sample: bool = False, seed: int | None = None,
           temperature: float = 1.0, edits=None) -> Tensor:
    """The full sequence ``(pos,)``: ``ids`` and up to ``max_new_tokens`` tokens from transformers' own
    ``generate`` (greedy, or sampling from the softmax at ``temperature`` with no top-k / top-p cut, seeded by
    ``seed`` without touching the global random state), stopping after the end-of-sequence token.

    ``edits``: the engine's edits (:class:`~lenscope.models.runtime.engine.Edit`, row 0, positions counted from the
    start of the prompt) applied at every decoding step, through lenscope's own loop with the key/value cache (see
    :func:`_decode_edited`); or a function ``(prompt_len, max_len) -> edits``. An empty list applies nothing and
    uses transformers' ``generate``, like None."""
    from ..models.loading.devices import main_device

    tok = lm.tokenizer
    eos = _eos(lm)
    edits = _edit_list(lm, edits, ids.numel(), max_new_tokens)
    if edits:
        return _decode_edited(lm, ids, max_new_tokens, edits, eos, sample, seed, temperature)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    kw = dict(max_new_tokens=int(max_new_tokens), do_sample=bool(sample), eos_token_id=eos, pad_token_id=pad)
    if sample:
        kw.update(temperature=float(temperature), top_k=0, top_p=1.0)
    x = ids[None].to(main_device(lm.model))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(int(seed))
        out = lm.model.generate(x, attention_mask=torch.ones_like(x), **kw)
    return out[0].cpu()


# the generation settings a model's config may carry that change which token is the most likely one (forced first
# and last tokens, banned words, a minimum length, repetition penalties, ...), each set to the value that changes
# nothing: with a source every generated token is the argmax of the model's logits, the prediction its
# explanation explains (those the model's config set are named in the result's notes)
PLAIN = dict(forced_bos_token_id=None, forced_eos_token_id=None, bad_words_ids=None, min_length=0, min_new_tokens=None,
             no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, repetition_penalty=1.0,
             encoder_repetition_penalty=1.0, suppress_tokens=None, begin_suppress_tokens=None, sequence_bias=None,
             exponential_decay_length_penalty=None, guidance_scale=None, watermarking_config=None, stop_strings=None)


def _source(lm: LoadedModel, source, methods: list[str], *, chat: bool, sample: bool, edits, lens) -> Tensor | None:
    """An encoder-decoder model's source ids ``(src,)`` (None for a decoder, which is checked as before), with the
    one-line refusals of what generation with a source does not do yet."""
    A = lm.anatomy
    if source is None:
        if A.is_encoder_decoder:
            raise InputError(f"{lm.name} is an encoder-decoder (translation) model: generate needs its source text "
                             "(source=..., --source TEXT); the prompt is then the target prefix (may be empty)")
        require_decoder(lm, "generate", causal=True, instead="generation needs a causal decoder such as smollm2")
        return None
    if not A.is_encoder_decoder:
        raise InputError(f"a source is read by encoder-decoder (translation) models only; {lm.name} is a {A.family} "
                         "model: leave out source= (--source)")
    if sample:
        raise NotApplicableError("generation with a source is greedy for now; leave out sample=True (--sample)")
    if chat:
        raise NotApplicableError("--chat wraps a decoder's prompt in a chat template; with a source the text is the "
                                 "target prefix: leave out chat=True (--chat)")
    if edits is not None and not (isinstance(edits, (list, tuple)) and not edits):
        raise NotApplicableError("edits (--steer) with a source are not supported yet (the engine's key/value cache "
                                 "reads no source); leave them out")
    if lens is not None:
        raise NotApplicableError("a tuned lens reads a decoder-only model's states; with a source leave out lens= "
                                 "(--lens): the logit lens's prediction depth is given")
    bad = [m for m in methods if not table.get(m).reads_source]
    if bad:
        raise NotApplicableError(f"{', '.join(bad)} does not read a source yet; with a source explain by "
                                 f"{', '.join(table.source_readers())} (or none: explain=(), --explain '')")
    src, E = source_ids(lm, source), A.encoder  # checked before transformers' generate reads it
    if src.numel() == 0 or src.numel() > E.n_ctx:
        raise InputError(f"the source is {src.numel()} tokens long; the encoder reads 1 to {E.n_ctx}")
    if int(src.min()) < 0 or int(src.max()) >= E.vocab_size:
        raise InputError(f"source token ids must lie in 0..{E.vocab_size - 1}")
    return src


@torch.no_grad()
def decode_source(lm: LoadedModel, source: Tensor, ids: Tensor, max_new_tokens: int) -> tuple[Tensor, list[str]]:
    """An encoder-decoder model's decoder sequence ``(pos,)``: its input ``ids`` (from the decoder's start token:
    :func:`lenscope.models.loading.load.target_prefix_ids`) and up to ``max_new_tokens`` tokens of transformers' greedy
    ``generate`` given ``source (src,)``, stopping after the end-of-sequence token; and notes.

    ``ids`` go in as they are (``decoder_input_ids``, with ``decoder_start_token_id`` their first token, so that
    nothing is put before them) and the output must start with them. The model's settings that would change which
    token is the most likely (:data:`PLAIN`: e.g. Marian's ``forced_eos_token_id``, mBART-50's forced language
    code) are turned off, and each one that was set is named in a note: every token is the argmax of the model's
    logits, the prediction its explanation explains."""
    from ..models.loading.devices import main_device

    tok = lm.tokenizer
    eos = _eos(lm)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    gc = getattr(lm.model, "generation_config", None)
    off = {k: getattr(gc, k, None) for k in PLAIN}
    off = {k: v for k, v in off.items() if v is not None and v != PLAIN[k]}
    notes = [f"not applied (each token is the argmax of the model's logits): the model's generation settings "
             f"{', '.join(f'{k}={v!r}' for k, v in off.items())}"] if off else []
    dev = main_device(lm.model)
    x, d = source[None].to(dev), ids[None].to(dev)
    out = lm.model.generate(input_ids=x, attention_mask=torch.ones_like(x), decoder_input_ids=d,
                            decoder_start_token_id=int(ids[0]), max_new_tokens=int(max_new_tokens), do_sample=False,
                            num_beams=1, eos_token_id=eos, pad_token_id=pad, **PLAIN)[0].cpu()
    if out.numel() < ids.numel() or out[: ids.numel()].tolist() != ids.tolist():
        raise UnsupportedModelError(f"transformers' generate did not continue the decoder's input {ids.tolist()} "
                                    f"(it returned {out[: ids.numel() + 2].tolist()}...); {lm.anatomy.model_type} "
                                    "cannot be generated from a target prefix here")
    return out, notes


def _depth(lm: LoadedModel, lens: Lens, tr, rows: Tensor, final_top: Tensor, block: int = 6) -> Tensor:
    """Prediction depth (:mod:`lenscope.lenses.depth`) of positions ``rows`` from the trace's residual states.

    The depth is the first state from which the lens's top-1 agrees with the model's at every later state, so the
    states are read from the top down, ``block`` layers at a time (one float32 readout of all rows still agreeing:
    ``W_U`` read once per block), and a row stops at its first disagreement: the states below it cannot change
    its depth (they are left "disagreeing"). For the few rows of a generation the bfloat16 fast path's
    conversion costs more than it saves."""
    L = lm.anatomy.n_layers
    readout = Readout.from_anatomy(lm.anatomy)
    agree = torch.zeros(L, len(rows), dtype=torch.bool)
    alive = torch.arange(len(rows))
    hi = L
    while hi > 0 and len(alive):
        lo = max(0, hi - block)
        at = rows[alive]
        y = torch.cat([readout.features(lens.transform(tr.resid_pre[l][at].float(), l)) for l in range(lo, hi)])
        a = (readout.top1(y, exact=True).cpu().view(hi - lo, len(alive)) == final_top[alive][None])
        agree[lo:hi, alive] = a
        alive = alive[a.all(0)]  # still agreeing at every state so far: may settle lower
        hi = lo
    return depths_from_agreement(agree)


def _foils(lm: LoadedModel, foil, tokens: Tensor, runner: Tensor, notes: list) -> Tensor | None:
    if foil is None:
        return None
    if isinstance(foil, str) and foil == "runner-up":
        return runner.clone()
    f_id = Request.of(lm, foil=foil, generated=True).foil
    same = tokens == f_id
    if bool(same.any()):
        notes.append(f"the foil is the generated token at step(s) {same.nonzero()[:, 0].tolist()}: those steps are "
                     "contrasted with their runner-up instead")
    return torch.where(same, runner, torch.full_like(tokens, f_id))


def _options(methods: list[str], options: dict) -> None:
    takes = table.option_methods()
    for k in options:
        if k not in takes:
            raise InputError(f"unknown option {k!r}; generate takes {', '.join(takes)} for its methods")
        if not any(m in takes[k] for m in methods):
            raise InputError(f"option {k!r} applies to {', '.join(takes[k])} only")


def generate(lm: LoadedModel, prompt, max_new_tokens: int = 16, *, explain=(table.DEFAULT,), foil="runner-up",
             chat: bool = False, sample: bool = False, seed: int | None = None, temperature: float = 1.0,
             lens=None, progress=None, edits=None, source=None, **method_options) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` and explain every generated token.

    Greedy by default (the tokens of transformers' ``model.generate(..., do_sample=False)``); ``sample=True``
    draws from the softmax at ``temperature`` (reproducible with ``seed``). ``chat=True`` wraps ``prompt`` as
    a user message in the tokenizer's chat template (with the generation prompt). Generation stops after the
    end-of-sequence token.

    ``explain``: methods of :func:`lenscope.explain` (a list or a comma-separated string). The logit methods
    explain the generated token against ``foil``: ``"runner-up"`` (default; the most likely other token at that
    step), a token (its text or ``"#ID"``; a step that generated the foil itself is contrasted with its
    runner-up instead, and ``notes`` says so), or None (the token's logit alone). ALTI and value zeroing read
    no logit. ``lens``: a tuned lens (or its folder) for a second prediction depth. ``method_options``:
    ``steps`` / ``baseline`` (ig), ``batch_size`` (rows per pass of the gradient methods and erasure).
    ``progress(stage, done, total)`` is called as the stages advance.

    ``edits``: the engine's edits (:class:`~lenscope.models.runtime.engine.Edit`; row 0, positions counted from the
    start of the prompt, e.g. a steering vector from :func:`lenscope.steering.steering_edits`, or a head ablated while
    the model writes), or a function ``(prompt_len, max_len) -> edits``: applied at every decoding step (with
    the cache) and in the pass that the statistics and depths are read from. The explanations decompose the
    unedited model, so they are refused with edits (``explain=()``).

    ``source``: an encoder-decoder (translation) model's source text (or ids:
    :func:`lenscope.models.runtime.trace.source_ids`);
    ``prompt`` is then the target prefix (may be ``""``: the decoder reads its start token, and a multilingual
    tokenizer's target language code, :func:`lenscope.models.loading.load.target_prefix_ids`; ids are the decoder's
    input from its start token). Greedy, through transformers' ``generate`` (:func:`decode_source`); the scores run over
    the source's tokens and then the decoder's (``Generation.n_source``), by the methods that read a source
    (:func:`lenscope.attribution.methods.source_readers`). Sampling, ``chat``, ``edits`` and ``lens`` are refused
    with a source (one line each).
    """
    seconds = {}
    t0 = time.perf_counter()
    methods = _methods(explain)
    src = _source(lm, source, methods, chat=chat, sample=sample, edits=edits, lens=lens)
    _options(methods, method_options)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if sample and not temperature > 0:
        raise InputError(f"temperature must be positive, got {temperature!r}")
    if seed is not None and not sample:
        raise InputError("a seed only matters when sampling; add sample=True (--sample)")
    ids = _prompt_ids(lm, prompt, chat)
    edits = _edit_list(lm, edits, ids.numel(), max_new_tokens)
    if edits and methods:
        raise NotApplicableError("the explanations decompose the unedited model, so they do not apply to a "
                                 "generation with edits; leave explain empty (--explain '')")
    n_ctx = lm.anatomy.n_ctx
    if ids.numel() + max_new_tokens > n_ctx:
        raise InputError(f"the prompt ({ids.numel()} tokens) plus {max_new_tokens} new tokens is past the model's "
                         f"context of {n_ctx} tokens; ask for at most {max(0, n_ctx - ids.numel())}")
    for m in methods:  # what a method refuses of the prompt (erasure: one token)
        check = table.get(m).check_prompt
        if check is not None:
            check(ids.numel(), src is not None)
    f_given = None if foil is None or foil == "runner-up" else Request.of(lm, foil=foil, generated=True).foil  # now
    if isinstance(lens, str) or (lens is not None and not isinstance(lens, Lens)):
        from ..lenses.files import load_lens_dir

        lens = load_lens_dir(lens, lm)

    def report(stage, done, total):
        if progress is not None:
            progress(stage, done, total)

    report("generate", 0, max_new_tokens)
    notes: list = []
    if src is None:
        full = decode(lm, ids, max_new_tokens, sample=sample, seed=seed, temperature=temperature, edits=edits)
    else:
        full, notes = decode_source(lm, src, ids, max_new_tokens)
    seconds["generate"] = time.perf_counter() - t0
    P, n = ids.numel(), full.numel()
    report("generate", n - P, n - P)
    if n == P:
        raise InputError("the model generated no token")

    t = time.perf_counter()
    # with a source: one teacher-forced pass of the source and the whole decoder sequence (the decoder is causal)
    tr = trace(lm, full, edits=edits_within(edits or (), 0, n)) if src is None else trace(lm, full, source=src)
    rows = torch.arange(P - 1, n - 1)  # where each generated token was predicted
    tok = full[P:]
    logits = tr.logits[rows].float()
    logp = torch.log_softmax(logits, -1)
    prob = logp.gather(-1, tok[:, None].to(logp.device))[:, 0].exp().cpu()
    entropy = -(logp.exp() * logp).sum(-1).cpu()
    top2 = logits.topk(2, -1).indices.cpu()
    runner = torch.where(top2[:, 0] == tok, top2[:, 1], top2[:, 0])
    if src is not None and not bool((top2[:, 0] == tok).all()):  # greedy: only a near tie rounded otherwise
        notes.append(f"step(s) {(top2[:, 0] != tok).nonzero()[:, 0].tolist()}: the generated token is not the top-1 "
                     "of the teacher-forced pass (a near tie, rounded differently with the key/value cache)")
    foils = _foils(lm, f_given if f_given is not None else foil, tok, runner, notes)
    final_top = top2[:, 0]
    depth = _depth(lm, LogitLens(lm.anatomy, model_name=lm.name), tr, rows, final_top)
    tuned = _depth(lm, lens, tr, rows, final_top) if lens is not None else None
    seconds["trace"] = time.perf_counter() - t

    scores, invs = {}, {}
    positions = list(range(P, n))

    def f_input():
        from ..models.runtime.request import metric_of

        return metric_of(tr.logits[rows], "logit_diff", tok, foils).double()

    job = table.Rows(lm, tr, full, rows, tok, foils, method_options, progress, f_input)
    table_of = {m: table.get(m) for m in methods}
    # the trace-based methods first (one trace, shared parts), then the others; a group's methods (the two
    # gradient methods) come from one computation, timed together
    order = [m for m in methods if table_of[m].uses_trace] + [m for m in methods if not table_of[m].uses_trace]
    done = set()
    for m in order:
        if m in done:
            continue
        g = table_of[m].group
        group = [x for x in order if x not in done and table_of[x].group == g] if g is not None else [m]
        t = time.perf_counter()
        report(m, 0, 1)
        for x in group:
            scores[x], invs[x] = table_of[x].generation_rows(job)
            if table_of[x].uses_trace:
                context.check_rows(x, invs[x], lm, [f"the step at position {p}" for p in positions])
            done.add(x)
        for x in group:
            seconds[x] = (time.perf_counter() - t) / len(group)
        report(m, 1, 1)

    n_src = 0 if src is None else src.numel()
    names = {str(i): lm.tokenizer.decode([i]) for i in set(runner.tolist()) | set(
        [] if foils is None else foils.tolist())}
    settings = {"max_new_tokens": max_new_tokens, "chat": chat, "sample": sample, "seed": seed,
                "edits": len(edits or ()),
                "temperature": temperature, "foil": foil if foil is None or isinstance(foil, str) else int(foil),
                "lens": None if lens is None else getattr(lens, "kind", "tuned"),
                **{k: v for k, v in method_options.items() if isinstance(v, (int, float, str))}}
    return Generation(
        model=lm.name, prompt=prompt if isinstance(prompt, str) else lm.tokenizer.decode(ids), ids=full,
        text=lm.tokenizer.decode(tok),
        tokens=lm.tokenizer.batch_decode([[int(i)] for i in full]), prompt_len=P, methods=methods,
        prob=prob, entropy=entropy, runner_up=runner, depth=depth, tuned_depth=tuned,
        scores=stack_scores([scores[m] for m in methods], n_src + n - 1),
        invariant_error=torch.stack([invs[m].double() for m in methods]) if methods else torch.zeros(0, n - P),
        foil_ids=foils, token_names=names, settings=settings, seconds=seconds, notes=notes,
        **({} if src is None else {
            "source": source if isinstance(source, str) else lm.tokenizer.decode(src), "source_ids": src,
            "source_tokens": lm.tokenizer.batch_decode([[int(i)] for i in src]), "n_source": n_src}))
