"""Errors raised by lenscope. Every message says what was wrong and what to do about it."""


class LenscopeError(Exception):
    """Base class of every error lenscope raises on purpose."""


class UnknownModelError(LenscopeError):
    """The model name is neither a known name, a ``tiny:<family>`` name, nor an existing path."""


class UnsupportedModelError(LenscopeError):
    """The model loads, but its architecture (or a variant of it) is not supported."""


class MissingDependencyError(LenscopeError):
    """A package that holds a model's weights (or a needed library) is not installed."""


class InputError(LenscopeError):
    """The text, token or option given by the user cannot be used."""


class NotApplicableError(LenscopeError):
    """The method does not apply to this kind of model (e.g. a decoder-only view on an encoder)."""


class InvariantError(LenscopeError):
    """A decomposition does not add up to what the model computed; the method refuses to return numbers."""


class Stopped(Exception):
    """A computation was asked to stop before it finished, because nobody waits for its result any more (``lenscope
    serve``: the client went away). Not a :class:`LenscopeError`: nothing was wrong with the input."""


class RenamedWarning(DeprecationWarning):
    """An old name (of a ``Trace`` field, a site, a keyword) that lenscope still accepts; the message names the new
    one. Inside lenscope itself it is an error (``pyproject.toml``'s ``filterwarnings``): the library uses the new
    names only."""


# the files that resolve an old name: a warning names the line that used it, not these (nor a dataclass's generated
# __init__, "<string>")
_RESOLVERS = ("lenscope/errors.py", "lenscope/models/runtime/sites.py", "lenscope/models/runtime/engine.py",
              "lenscope/models/runtime/trace.py")


def warn_renamed(old: str, new: str) -> None:
    """Warn (:class:`RenamedWarning`) that ``old`` is deprecated in favour of ``new``, pointing at the first caller
    outside the code that resolves old names."""
    import sys
    import warnings

    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.replace("\\", "/").endswith(_RESOLVERS + ("<string>",)):
        frame, level = frame.f_back, level + 1
    warnings.warn(f"{old} is deprecated: use {new}", RenamedWarning, stacklevel=level)
