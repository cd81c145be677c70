"""Fixtures: tiny random models of every family (cached per session) and the embedded real models."""

from __future__ import annotations

import pytest

import lenscope
from lenscope.models.families import tiny_names

# TINY: the single-stack models (decoders and encoders), which every all-families test runs; SEQ2SEQ: the
# encoder-decoder ones (T5, BART, Marian), run by the tests of what applies to them (tests/models/test_seq2seq.py)
SEQ2SEQ = sorted(n for n, f in tiny_names().items() if f.encoder_decoder)
TINY = sorted(n for n in tiny_names() if n not in SEQ2SEQ)
DECODERS = [n for n in TINY if not tiny_names()[n].encoder]
ENCODERS = [n for n in TINY if tiny_names()[n].encoder]
REAL = ["smollm2", "gemma3-270m", "minilm"]

_cache: dict = {}


def get_model(name: str):
    if name not in _cache:
        _cache[name] = lenscope.load(name)
    return _cache[name]


@pytest.fixture(params=TINY)
def tiny(request):
    return get_model(f"tiny:{request.param}")


@pytest.fixture(params=DECODERS)
def tiny_decoder(request):
    return get_model(f"tiny:{request.param}")


@pytest.fixture(params=ENCODERS)
def tiny_encoder(request):
    return get_model(f"tiny:{request.param}")


@pytest.fixture(scope="session")
def smollm2():
    return get_model("smollm2")


@pytest.fixture(scope="session")
def gemma3():
    return get_model("gemma3-270m")


@pytest.fixture(scope="session")
def minilm():
    return get_model("minilm")


def tiny_with_layers(family: str, n_layers: int):
    """A ``tiny:<family>`` model with ``n_layers`` blocks (same seed and recipe as ``lenscope.load``)."""
    key = (family, n_layers)
    if key not in _cache:
        from lenscope.models.loading.load import LoadedModel, random_model
        from lenscope.models.loading.tokenizer import tiny_special_ids, tiny_tokenizer

        fam = tiny_names()[family]
        cfg = fam.tiny[family](tiny_special_ids())
        text = cfg.get_text_config()  # a multimodal config's text part (the config itself otherwise)
        text.num_hidden_layers = n_layers
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = text.layer_types[:n_layers]
        model = random_model(cfg, kind=fam.kind)
        model.eval()
        model.requires_grad_(False)
        _cache[key] = LoadedModel(model=model, tokenizer=tiny_tokenizer(kind=fam.kind),
                                  anatomy=fam.read(model), name=f"tiny:{family}")
    return _cache[key]


def module_output(o):
    """A hooked module's output tensor: the first element where the module returns a tuple (GPT-OSS's MoE block
    returns its router scores beside its output)."""
    return o[0] if isinstance(o, tuple) else o


def with_module_output(o, new):
    """A hooked module's output ``o`` with its output tensor replaced by ``new`` (see :func:`module_output`)."""
    return (new,) + tuple(o[1:]) if isinstance(o, tuple) else new


def jsonl_records(path) -> list:
    """The records of a ``records.jsonl`` file, parsed."""
    import json
    from pathlib import Path

    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


# ---------------------------------------------------------------- CI: no quiet skips
# In CI (the environment variable CI is set, as .ci/run's caller does) a skip is allowed only when its reason
# matches tests/allowed_skips.txt; any other skip (no browser, no Ray, no torchrun ...) fails the run.
import os as _os  # noqa: E402
import re as _re  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_ALLOWED = _Path(__file__).with_name("allowed_skips.txt")
_skips: list[tuple[str, str]] = []


def allowed_skip_patterns() -> list[str]:
    lines = _ALLOWED.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def skip_is_allowed(reason: str) -> bool:
    return any(_re.search(p, reason) for p in allowed_skip_patterns())


def _strict() -> bool:
    return _os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        lr = report.longrepr
        reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
        _skips.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _strict():
        return
    bad = [(n, r) for n, r in _skips if not skip_is_allowed(r)]
    if bad:
        terminalreporter.section("skips that CI does not allow (tests/allowed_skips.txt)", red=True)
        for n, r in bad:
            terminalreporter.line(f"{n}: {r}")


def pytest_sessionfinish(session, exitstatus):
    if _strict() and any(not skip_is_allowed(r) for _, r in _skips) and session.exitstatus == 0:
        session.exitstatus = 1
