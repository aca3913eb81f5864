"""OpenAI's text graders: ``string_check`` and ``text_similarity``, over templates of the sample
and the row (:mod:`jobspec.templates`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from grading.graders.base import Item
from jobspec.graders import StringCheckGrader, TextSimilarityGrader
from jobspec.templates import render, sample_namespace

__all__ = ["MAX_SIMILARITY_CHARS", "SIMILARITY", "StringCheck", "TextSimilarity"]

# Similarity measures are quadratic in the worst case (ROUGE-L's longest common subsequence):
# each side is cut to this many characters (its head) before it is compared.
MAX_SIMILARITY_CHARS = 4_000


def _render_pair(input_t: str, reference_t: str, completion: str, item: Item) -> tuple[str, str]:
    sample = sample_namespace(completion)
    return render(input_t, sample=sample, item=item), render(reference_t, sample=sample, item=item)


_OPERATIONS: dict[str, Callable[[str, str], bool]] = {
    "eq": lambda text, ref: text == ref,
    "ne": lambda text, ref: text != ref,
    "like": lambda text, ref: ref in text,
    "ilike": lambda text, ref: ref.casefold() in text.casefold(),
}


@dataclass(frozen=True)
class StringCheck:
    """1.0 when the rendered ``input`` and ``reference`` compare as ``operation`` says."""

    name: str
    weight: float
    input: str
    reference: str
    operation: str

    @classmethod
    def from_spec(cls, spec: StringCheckGrader, name: str) -> StringCheck:
        return cls(name, spec.weight, spec.input, spec.reference, spec.operation)

    def __call__(self, completion: str, item: Item) -> float:
        text, ref = _render_pair(self.input, self.reference, completion, item)
        return 1.0 if _OPERATIONS[self.operation](text, ref) else 0.0


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
# jobspec.graders.SIMILARITY_METRICS (tests/grading/test_graders_openai.py).
SIMILARITY: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": _fuzzy,
    "bleu": _bleu,
    "gleu": _gleu,
    **{f"rouge_{n}": _rouge(f"rouge{n}") for n in range(1, 6)},
    "rouge_l": _rouge("rougeL"),
}


@dataclass(frozen=True)
class TextSimilarity:
    """The similarity of the rendered ``input`` to the rendered ``reference``."""

    name: str
    weight: float
    input: str
    reference: str
    metric: str

    @classmethod
    def from_spec(cls, spec: TextSimilarityGrader, name: str) -> TextSimilarity:
        return cls(name, spec.weight, spec.input, spec.reference, spec.evaluation_metric)

    def __call__(self, completion: str, item: Item) -> float:
        text, ref = _render_pair(self.input, self.reference, completion, item)
        similarity = SIMILARITY[self.metric](
            text[:MAX_SIMILARITY_CHARS], ref[:MAX_SIMILARITY_CHARS]
        )
        return min(1.0, max(0.0, similarity))  # rounding can land a hair outside [0, 1]
