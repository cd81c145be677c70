"""Write the steering contrast sets of docs/steering.md (sentiment and tense): every sentence is from templates and
word lists written for lenscope (no third-party text, so no licence beyond lenscope's own), drawn with a fixed seed.

Per behaviour: ``<b>_pairs.csv`` (positive,negative: the pairs a direction is built from), ``<b>_heldout.csv``
(text,answer_positive,answer_negative: 128 inputs it is measured on, in other templates than the pairs) and
``<b>_transfer.csv`` (the same columns in a third phrasing: transfer). Run from the repository root:

    .venv/bin/python benchmarks/data/steering/make_sets.py
"""

from __future__ import annotations

import csv
import itertools
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------- sentiment

THINGS = ["movie", "meal", "concert", "hotel", "book", "trip", "game", "party", "show", "museum", "class", "album",
          "restaurant", "play", "festival", "lecture"]
POS = ["wonderful", "excellent", "delightful", "fantastic", "lovely", "great", "amazing", "superb"]
NEG = ["terrible", "awful", "dreadful", "horrible", "disappointing", "bad", "miserable", "poor"]
OPINION = ["I thought the {t} was {a}.", "Honestly, the {t} was {a}.", "Everyone agreed that the {t} was {a}.",
           "In my opinion the {t} was {a}.", "We all felt the {t} was {a}.", "To be fair, the {t} was {a}."]
# held-out: a neutral account, then the judgement is asked for
VISITS = ["Last weekend I went to the new {t} everyone talks about.", "On Friday my friends took me to a {t}.",
          "I finally tried the {t} my sister recommended.", "Yesterday we spent the evening at a {t}.",
          "My parents and I went to the {t} after work.", "This morning I read a review and then tried the {t}."]
CLOSE = ["All in all, it was", "To sum up, the {t} was", "My honest verdict: it was", "I have to say it was"]
ANSWERS = [(" great", " terrible"), (" good", " bad"), (" wonderful", " awful"), (" fun", " boring")]
# transfer: a question and an answer
QUESTIONS = ["Q: How was the {t} last night?\nA: It was", "Friend: So, what did you think of the {t}?\nMe: It was",
             "Question: Would you describe the {t} as good or bad?\nAnswer: I would say it was"]

# ---------------------------------------------------------------------------------------------- tense

SUBJ_S = ["the dog", "my neighbour", "the old man", "the teacher", "our cat", "the farmer", "my sister", "the pilot",
          "the baker", "the doctor", "his uncle", "the singer"]
SUBJ_P = ["the children", "my parents", "the soldiers", "our friends", "the birds", "the students", "the workers",
          "the tourists"]
VERBS = [("walked to the market", "walks to the market"), ("played in the garden", "plays in the garden"),
         ("cooked dinner for everyone", "cooks dinner for everyone"), ("opened the window", "opens the window"),
         ("watched the news", "watches the news"), ("cleaned the kitchen", "cleans the kitchen"),
         ("visited the library", "visits the library"), ("painted the fence", "paints the fence")]
VERBS_P = [("walked to the market", "walk to the market"), ("played in the garden", "play in the garden"),
           ("cooked dinner for everyone", "cook dinner for everyone"), ("opened the window", "open the window"),
           ("watched the news", "watch the news"), ("cleaned the kitchen", "clean the kitchen")]
# held-out: the subject, then a copula either tense fits
FRAMES = ["{s}", "I think {s}", "As far as I know, {s}", "Around noon {s}", "According to my notes, {s}",
          "I noticed that {s}", "In the photo, {s}", "By the river {s}"]
# transfer: reported speech and lists
REPORTS = ["She told me on the phone that {s}", "The letter said that {s}", "Note to self: {s}",
           "He wrote in his diary that {s}"]


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def write(name: str, header: list[str], rows: list[tuple]) -> None:
    with (OUT / name).open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)


def sentiment(rng: random.Random) -> None:
    pairs = []
    for i, (t, tpl) in enumerate(itertools.product(THINGS[:8], OPINION)):
        k = i % len(POS)
        pairs.append((tpl.format(t=t, a=POS[k]), tpl.format(t=t, a=NEG[k])))
    rng.shuffle(pairs)
    write("sentiment_pairs.csv", ["positive", "negative"], pairs[:48])
    held = []
    for t, v, c, a in itertools.product(THINGS, VISITS, CLOSE, ANSWERS):
        held.append((f"{v.format(t=t)} {c.format(t=t)}", *a))
    write("sentiment_heldout.csv", ["text", "answer_positive", "answer_negative"], rng.sample(held, 128))
    trans = [(q.format(t=t), *a) for t, q, a in itertools.product(THINGS, QUESTIONS, ANSWERS)]
    write("sentiment_transfer.csv", ["text", "answer_positive", "answer_negative"], rng.sample(trans, 64))


def tense(rng: random.Random) -> None:
    pairs = [(f"{cap(s)} {p}.", f"{cap(s)} {q}.") for s, (p, q) in itertools.product(SUBJ_S, VERBS)]
    pairs += [(f"{cap(s)} {p}.", f"{cap(s)} {q}.") for s, (p, q) in itertools.product(SUBJ_P, VERBS_P)]
    rng.shuffle(pairs)
    write("tense_pairs.csv", ["positive", "negative"], pairs[:48])

    def inputs(frames):
        out = []
        for f, s in itertools.product(frames, SUBJ_S + SUBJ_P):
            text = f.format(s=s)
            out.append((cap(text), *((" was", " is") if s in SUBJ_S else (" were", " are"))))
        return out

    write("tense_heldout.csv", ["text", "answer_positive", "answer_negative"], rng.sample(inputs(FRAMES), 128))
    write("tense_transfer.csv", ["text", "answer_positive", "answer_negative"], rng.sample(inputs(REPORTS), 64))


if __name__ == "__main__":
    sentiment(random.Random(0))
    tense(random.Random(1))
    for p in sorted(OUT.glob("*.csv")):
        print(p.name, sum(1 for _ in p.open()) - 1, "rows")
