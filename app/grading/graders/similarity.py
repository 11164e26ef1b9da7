"""The `text_similarity` grader and its metrics: fuzzy_match, bleu, gleu, meteor, rouge_1..5, rouge_l, cosine.

Every metric gives a value in [0, 1] that is the score (`pass_threshold` is kept for compatibility but
does not turn the score into 0/1, as on the platform). Two empty texts score 1 and one empty text 0,
for every metric, so an empty model answer never reaches a library that would raise on it.

- fuzzy_match: rapidfuzz `WRatio` with its default preprocessing (lower case, no punctuation) / 100, of
  the texts' first FUZZY_MAX_CHARS characters (its partial matching of texts of unlike lengths grows
  with the product of the two: uncut, an answer of 100,000 characters against a reference of 5,000
  held a thread for seconds).
- bleu: NLTK sentence BLEU-4 with smoothing (method 1) and weights re-balanced for texts shorter than
  four tokens, so two identical short texts score 1.
- gleu: NLTK sentence GLEU (1- to 4-grams).
- meteor: NLTK METEOR; it needs the WordNet data, and a config using it is refused at start-up when
  the data is not installed (`python -m nltk.downloader wordnet`), since it cannot run offline without.
- rouge_n / rouge_l: F-measure from Google's `rouge-score`, with a Unicode-aware tokenizer (its default
  one drops every non-ASCII letter).
- cosine: cosine similarity of the two texts' embeddings from the judge endpoint, floored at 0.

Texts are cut to MAX_TOKENS tokens for the token metrics (ROUGE-L is quadratic) and long ones are scored
in a thread, so one huge answer cannot stall the event loop.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, Protocol

from rapidfuzz import fuzz, utils

from app.grading.graders.model import GradeInput, GradeResult
from app.grading.graders.templates import Scope, Template

MAX_TOKENS = 2000
FUZZY_MAX_CHARS = 5000
THREAD_THRESHOLD_CHARS = 5000

Metric = Callable[[str, str], float]  # (input, reference) -> [0, 1]

_WORDS = re.compile(r"\w+|[^\w\s]")
_ROUGE_WORDS = re.compile(r"\w+")


class MetricUnavailable(RuntimeError):
    """The metric cannot run on this machine (missing data); the message says how to fix it."""


class Embedder(Protocol):
    async def embed(self, model: str, texts: Sequence[str]) -> list[list[float]]: ...


def tokens(text: str) -> list[str]:
    return _WORDS.findall(text)[:MAX_TOKENS]


def fuzzy_match(candidate: str, reference: str) -> float:
    cut, kept = candidate[:FUZZY_MAX_CHARS], reference[:FUZZY_MAX_CHARS]
    return float(fuzz.WRatio(cut, kept, processor=utils.default_process)) / 100.0


def bleu(candidate: str, reference: str) -> float:
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    hypothesis, references = tokens(candidate), [tokens(reference)]
    if not hypothesis or not references[0]:
        return 0.0
    # Smoothing (which also keeps NLTK from warning about zero n-gram counts) and re-weighting for
    # texts shorter than four tokens.
    value = sentence_bleu(
        references, hypothesis, smoothing_function=SmoothingFunction().method1, auto_reweigh=True
    )
    return float(value)


def gleu(candidate: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    hypothesis, references = tokens(candidate), [tokens(reference)]
    if not hypothesis or not references[0]:
        return 0.0
    return float(sentence_gleu(references, hypothesis))


def wordnet_available() -> bool:
    """Whether NLTK can load WordNet (what METEOR needs for synonyms) without a download."""
    try:
        from nltk.corpus import wordnet

        wordnet.ensure_loaded()
    except LookupError:
        return False
    return True


def meteor(candidate: str, reference: str, *, wordnet: Any = None) -> float:
    from nltk.translate.meteor_score import meteor_score

    if wordnet is None:
        from nltk.corpus import wordnet as loaded

        wordnet = loaded
    hypothesis, references = tokens(candidate), [tokens(reference)]
    if not hypothesis or not references[0]:
        return 0.0
    return float(meteor_score(references, hypothesis, wordnet=wordnet))


class _UnicodeTokenizer:
    """rouge-score's tokenizer interface: lower-cased words of any script."""

    def tokenize(self, text: str) -> list[str]:
        return _ROUGE_WORDS.findall(text.lower())[:MAX_TOKENS]


@cache
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer([rouge_type], use_stemmer=False, tokenizer=_UnicodeTokenizer())


def rouge(rouge_type: str) -> Metric:
    def metric(candidate: str, reference: str) -> float:
        scores = _rouge_scorer(rouge_type).score(reference, candidate)  # (target, prediction)
        return float(scores[rouge_type].fmeasure)

    return metric


ROUGE_TYPES = {f"rouge_{n}": f"rouge{n}" for n in range(1, 6)} | {"rouge_l": "rougeL"}


def local_metric(name: str) -> Metric:
    """The metric function for every metric but cosine; MetricUnavailable when it cannot run here."""
    if name == "fuzzy_match":
        return fuzzy_match
    if name == "bleu":
        return bleu
    if name == "gleu":
        return gleu
    if name == "meteor":
        if not wordnet_available():
            raise MetricUnavailable(
                "meteor needs NLTK's WordNet data, which is not installed on this machine; install it "
                "with `python -m nltk.downloader wordnet` (or set NLTK_DATA), or choose another metric"
            )
        return meteor
    if name in ROUGE_TYPES:
        return rouge(ROUGE_TYPES[name])
    raise MetricUnavailable(f"unknown metric {name!r}")


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=False))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    if norm == 0 or not math.isfinite(dot / norm):
        return 0.0
    return max(0.0, min(1.0, dot / norm))


def _clip(value: float) -> float:
    if not math.isfinite(value):
        return 0.0
    return max(0.0, min(1.0, value))


class TextSimilarityGrader:
    def __init__(
        self,
        *,
        name: str,
        version: str,
        metric_name: str,
        input: Template,
        reference: Template,
        metric: Metric | None = None,
        embedder: Embedder | None = None,
        embedding_model: str = "",
    ) -> None:
        if (metric is None) == (embedder is None):
            raise ValueError("a text_similarity grader needs either a local metric or an embedder")
        self.name = name
        self.version = version
        self.metric_name = metric_name
        self.input = input
        self.reference = reference
        self.metric = metric
        self.embedder = embedder
        self.embedding_model = embedding_model
        self.needs_rollout = input.uses_rollout or reference.uses_rollout

    async def grade(self, inp: GradeInput) -> GradeResult:
        scope = Scope.of(inp)
        candidate, reference = self.input.render(scope), self.reference.render(scope)
        if not candidate.strip() or not reference.strip():
            same = not candidate.strip() and not reference.strip()
            return GradeResult(score=1.0 if same else 0.0)
        if self.embedder is not None:
            vectors = await self.embedder.embed(self.embedding_model, [candidate, reference])
            return GradeResult(score=cosine(vectors[0], vectors[1]))
        assert self.metric is not None
        if len(candidate) + len(reference) > THREAD_THRESHOLD_CHARS:
            value = await asyncio.to_thread(self.metric, candidate, reference)
        else:
            value = self.metric(candidate, reference)
        return GradeResult(score=_clip(value))
