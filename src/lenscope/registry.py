"""One kind of table for lenscope's plug-ins (issue 43): named entries in the order they were registered.

The attribution methods (:mod:`lenscope.attribution.methods`), the steering direction builders
(:mod:`lenscope.steering.builders`) and the sparse-dictionary kinds (:mod:`lenscope.models.dictionaries.kinds`) are
each a :class:`Table` of their entries; what the CLI offers (choices, help), the report, ``serve`` and the Python
API read from the table, so an entry registered from one file is found everywhere. Layer 0: imports nothing of
lenscope but :mod:`lenscope.errors`, and no torch.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from .errors import InputError

T = TypeVar("T")


class Table(Generic[T]):
    """Entries named by their ``name`` attribute, in registration order.

    ``what``: the entry in words with its article, for the refusal of a second entry of one name ("an attribution
    method"); ``unknown``: the one-line message of :meth:`get` for a name not in the table, a format string with
    ``{name!r}``, ``{names}`` (the names joined by ", ") and any keywords :meth:`get` is given."""

    def __init__(self, what: str, unknown: str) -> None:
        self.what, self.unknown = what, unknown
        self._entries: dict[str, T] = {}

    def register(self, entry: T) -> T:
        """Add ``entry`` (last in :meth:`names`); an empty name or one already there is a ``ValueError``."""
        name = getattr(entry, "name", None)
        if not name or name in self._entries:
            why = "" if name else " (or has no name)"
            raise ValueError(f"{self.what} named {name!r} is already registered{why}")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def entries(self) -> list[T]:
        return list(self._entries.values())

    def lookup(self, name: str) -> T | None:
        return self._entries.get(name)

    def get(self, name: str, **words: str) -> T:
        """The entry named ``name``, or an :class:`~lenscope.errors.InputError` naming the entries there are."""
        entry = self._entries.get(name)
        if entry is None:
            raise InputError(self.unknown.format(name=name, names=", ".join(self._entries), **words))
        return entry


__all__ = ["Table"]
