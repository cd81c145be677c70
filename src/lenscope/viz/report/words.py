"""The words of the report's views: each view's title (its card's heading) and blurb (the line under it), in one
place for the report's sections (:mod:`lenscope.report.sections`), the app's cards (:mod:`lenscope.viz.app`) and
the titles of single results' pages (:mod:`lenscope.viz.views`). The generation view's words live with its
drawing (:mod:`lenscope.viz.generation_html`)."""

from __future__ import annotations

from typing import NamedTuple


class Words(NamedTuple):
    title: str
    blurb: str


# in the order of the report's sections
WORDS: dict[str, Words] = {
    "prediction": Words("Prediction", (
        "The model's most likely next tokens at the last position, "
        "and whether lenscope's math reproduces the model.")),
    "trajectory": Words("Prediction trajectory", (
        "What each layer's residual stream already predicts, read through the logit lens "
        "(and a tuned or Patchscope lens when given): top token per layer and position.")),
    "components": Words("Direct logit attribution", (
        "The logit as an exact sum of what the embedding, each layer's attention (each head) and each MLP "
        "wrote.")),
    "attribution": Words("Context attribution", (
        "Which input tokens made the model predict the target (rather than the foil): every method side "
        "by side, and ALTI-Logit per layer.")),
    "mixing": Words("Context-mixing maps", (
        "Norm-based maps ||F_i(x_j)||: how much of token i's state after each scope of a layer comes from "
        "input token j (Kobayashi et al.). Rows: positions; columns: sources.")),
    "flow": Words("Information flow", (
        "ALTI contributions across layers: a node per token and layer, an edge where a token's state "
        "draws on another's above the threshold.")),
    "circuit": Words("Circuit", (
        "Which components, and which connections between them, carry logit(target) - logit(foil) from the "
        "corrupted prompt to the clean one (EAP-IG edge attribution): the top-k edges by |score|, and how much "
        "of the clean run a circuit of k edges keeps with every other edge patched to its corrupted value "
        "(faithfulness: 0 = corrupted run, 1 = clean run).")),
    "features": Words("Features", (
        "Which features of the sparse dictionaries fire at each token (darker: stronger). Click a token for its "
        "active features; a feature in bold opens its card: its top-activating contexts on held-out text, its "
        "activation histogram and density, the tokens its decoder direction promotes and suppresses.")),
    "graph": Words("Attribution graph", (
        "The prediction explained through transcoder features (Ameisen et al. 2025): each edge a direct effect through "
        "the model frozen at the real run, exact. Rows: the tokens' embeddings, each block, the logits; columns: "
        "positions. The slider prunes by influence on the logits; click a node for its details, shift-click to "
        "select nodes and group them into a supernode.")),
    "alignment": Words("Source-target alignment", (
        "A translation model's explanation of every target token (rows) over the source tokens and the target-prefix "
        "tokens it read (columns), by each method that reads a source; below, each target word's best source word "
        "(dots) and, with gold links, the sure (solid) and possible (dashed) ones and each method's AER.")),
}
