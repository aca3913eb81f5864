"""OpenAI's ``text_similarity`` grader: how similar two templates of the sample and the row
(:mod:`grading.templates`) are, by a measure of well-kept libraries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, get_args

from pydantic import Field

from grading.graders.base import ComparesTexts, Item, TextPair

__all__ = [
    "MAX_SIMILARITY_CHARS",
    "SIMILARITY",
    "SIMILARITY_METRICS",
    "TextSimilarity",
    "TextSimilarityGrader",
]

SimilarityMetric = Literal[
    "fuzzy_match",
    "bleu",
    "gleu",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
]
SIMILARITY_METRICS: tuple[str, ...] = get_args(SimilarityMetric)

# Similarity measures are quadratic in the worst case (ROUGE-L's longest common subsequence):
# each side is cut to this many characters (its head) before it is compared.
MAX_SIMILARITY_CHARS = 4_000


class TextSimilarityGrader(ComparesTexts):
    """OpenAI's text_similarity: the similarity of ``input`` to ``reference`` in [0, 1] by
    ``evaluation_metric`` (fuzzy_match: rapidfuzz's normalised ratio; bleu: sacrebleu's sentence
    BLEU / 100; gleu: NLTK's sentence GLEU over whitespace tokens; rouge_1..5 and rouge_l: the
    rouge-score F-measure)."""

    type: Literal["text_similarity"]
    evaluation_metric: SimilarityMetric = Field(
        description=(
            "The similarity measure (OpenAI's meteor and cosine are not offered: they need "
            "WordNet data or an embedding model that an offline worker does not have)."
        )
    )
    pass_threshold: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description=(
            "Accepted for OpenAI compatibility; the reward is the similarity itself, whatever "
            "the threshold."
        ),
    )

    def build(self, name: str) -> TextSimilarity:
        return TextSimilarity(name, self.weight, self.input, self.reference, self.evaluation_metric)


def _fuzzy(text: str, ref: str) -> float:
    from rapidfuzz import fuzz

    return float(fuzz.ratio(text, ref)) / 100.0


def _bleu(text: str, ref: str) -> float:
    import sacrebleu

    return float(sacrebleu.sentence_bleu(text, [ref]).score) / 100.0


def _gleu(text: str, ref: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([ref.split()], text.split()))


@cache
def _rouge_scorer(kind: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([kind], use_stemmer=False)


def _rouge(kind: str) -> Callable[[str, str], float]:
    def score(text: str, ref: str) -> float:
        return float(_rouge_scorer(kind).score(ref, text)[kind].fmeasure)

    return score


# evaluation_metric -> (input text, reference text) -> similarity in [0, 1]. Keys equal
# SIMILARITY_METRICS (tests/grading/test_graders_openai.py).
SIMILARITY: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": _fuzzy,
    "bleu": _bleu,
    "gleu": _gleu,
    **{f"rouge_{n}": _rouge(f"rouge{n}") for n in range(1, 6)},
    "rouge_l": _rouge("rougeL"),
}


@dataclass(frozen=True)
class TextSimilarity(TextPair):
    """The similarity of the rendered ``input`` to the rendered ``reference``."""

    metric: str

    def __call__(self, completion: str, item: Item) -> float:
        text, ref = self.rendered(completion, item)
        similarity = SIMILARITY[self.metric](
            text[:MAX_SIMILARITY_CHARS], ref[:MAX_SIMILARITY_CHARS]
        )
        return min(1.0, max(0.0, similarity))  # rounding can land a hair outside [0, 1]
