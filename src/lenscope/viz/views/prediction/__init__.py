"""The prediction view: the model's most likely next tokens and whether lenscope's math reproduces the model (its
data computed by the report: :class:`lenscope.report.sections.Prediction`)."""

from __future__ import annotations

from .. import View


class Prediction(View):
    key = "prediction"
    title = "Prediction"
    blurb = ("The model's most likely next tokens at the last position, "
             "and whether lenscope's math reproduces the model.")
    order = 10
    height = 360


VIEW = Prediction()
