"""lenscope's own indirect-object-identification (IOI) sentences, seeded and reproducible.

Each sentence introduces two people, then one of them (the subject, S) hands something to the other (the
indirect object, IO); the prefix stops right before the IO's second mention. The model should continue with
the IO (target), not the repeated subject (foil). Two orders of the introduction:

- ``ABBA``: the IO is named first ("... Ada and Bruno ... Bruno gave ... to" -> " Ada");
- ``BABA``: the subject is named first ("... Bruno and Ada ... Bruno gave ... to" -> " Ada").

The templates, names, places and objects below were written for lenscope (in the spirit of Wang et al. 2022,
"Interpretability in the Wild"); they are not copied from any other list. ``random.Random(seed)`` drives every
choice, so the same seed gives the same sentences on every machine and Python version.
"""

from __future__ import annotations

import random

# {A} and {B} are the introduced pair (order set by the pattern), {S} the subject's second mention.
TEMPLATES = (
    "After {A} and {B} arrived at the {place}, {S} passed the {obj} to",
    "While {A} and {B} were waiting at the {place}, {S} handed the {obj} to",
    "Yesterday {A} and {B} walked to the {place}, and {S} offered the {obj} to",
    "{A} and {B} spent the morning at the {place}. Later {S} lent the {obj} to",
    "Once {A} and {B} had reached the {place}, {S} threw the {obj} to",
    "{A} and {B} met at the {place} on Sunday. {S} showed the {obj} to",
    "At the {place}, {A} and {B} found a {obj}. {S} gave it to",
    "When {A} and {B} got back from the {place}, {S} sold the {obj} to",
    "On a quiet evening {A} and {B} sat in the {place}, then {S} brought the {obj} to",
    "{A} and {B} were cleaning the {place} when {S} tossed the {obj} to",
    "Before {A} and {B} left the {place}, {S} returned the {obj} to",
    "During lunch at the {place}, {A} and {B} talked, and {S} sent the {obj} to",
)

NAMES = (
    "Alice", "Brian", "Carla", "Daniel", "Emma", "Frank", "Grace", "Henry", "Irene", "Jason", "Karen", "Louis",
    "Maria", "Nathan", "Olivia", "Peter", "Rachel", "Samuel", "Sarah", "Thomas", "Laura", "Victor", "Helen",
    "Walter", "Julia", "George", "Anna", "Oscar", "Linda", "Martin", "Paul", "Ruth", "Steven", "Diana", "Kevin",
    "Nancy", "Eric", "Amy", "Roger", "Lucy",
)

PLACES = (
    "station", "library", "market", "garden", "harbor", "museum", "bakery", "office", "kitchen", "beach",
    "stadium", "farm", "cinema", "hospital", "school",
)

OBJECTS = (
    "ticket", "letter", "basket", "hammer", "lamp", "notebook", "ball", "bottle", "camera", "map", "coin",
    "umbrella", "blanket", "guitar", "key",
)


def generate_ioi(n: int = 1000, seed: int = 0) -> list[dict]:
    """``n`` IOI examples, alternating ABBA and BABA. Each is a dict with ``prefix``, ``target`` (the IO's
    name), ``foil`` (the subject's name), ``pattern``, ``io`` / ``s`` (the names) and ``io_spans`` /
    ``s_spans``: the character spans ``[start, end)`` of every mention of each name in the prefix (IO once,
    the subject twice)."""
    if n < 0:
        raise ValueError("n must be non-negative")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        template = rng.choice(TEMPLATES)
        io, s = rng.sample(NAMES, 2)
        place, obj = rng.choice(PLACES), rng.choice(OBJECTS)
        pattern = "ABBA" if i % 2 == 0 else "BABA"
        first, second = (io, s) if pattern == "ABBA" else (s, io)
        prefix = template.format(A=first, B=second, S=s, place=place, obj=obj)
        out.append({
            "prefix": prefix, "target": io, "foil": s, "pattern": pattern, "io": io, "s": s,
            "io_spans": _spans(prefix, io), "s_spans": _spans(prefix, s), "template": TEMPLATES.index(template),
        })
    return out


def _spans(text: str, word: str) -> list[list[int]]:
    import re

    return [[m.start(), m.end()] for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text)]
