"""The circuit view: the top edges of an EAP-IG circuit and its faithfulness curve (its data computed by the report:
:class:`lenscope.report.sections.Circuit`)."""

from __future__ import annotations

from .. import View


class Circuit(View):
    key = "circuit"
    title = "Circuit"
    blurb = ("Which components, and which connections between them, carry logit(target) - logit(foil) from the "
             "corrupted prompt to the clean one (EAP-IG edge attribution): the top-k edges by |score|, and how much "
             "of the clean run a circuit of k edges keeps with every other edge patched to its corrupted value "
             "(faithfulness: 0 = corrupted run, 1 = clean run).")
    order = 70
    height = 700


VIEW = Circuit()
