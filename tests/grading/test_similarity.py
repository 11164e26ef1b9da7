"""text_similarity: every local metric on known pairs, the empty-text rules, and meteor's data check."""

from __future__ import annotations

from typing import Any

import pytest
from rapidfuzz import fuzz, utils

from app.grading.graders import similarity
from app.grading.graders.model import GraderConfigError
from app.grading.graders.registry import GraderContext, build_graders
from app.grading.graders.similarity import MetricUnavailable, local_metric, meteor
from tests.grading.records import grade_input

LOCAL_METRICS = [
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


def config(metric: str) -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "name": "similar",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.reference_answer }}",
        "evaluation_metric": metric,
        "pass_threshold": 0.8,
    }


async def score(context: GraderContext, metric: str, answer: str, reference: str) -> float:
    grader = build_graders({"similar": config(metric)}, source="test", context=context)["similar"]
    result = await grader.grade(grade_input(answer, {"reference_answer": reference}))
    assert result.errors == []
    return result.score


@pytest.mark.parametrize("metric", LOCAL_METRICS)
async def test_identical_texts_score_1(context: GraderContext, metric: str) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    assert await score(context, metric, text, text) == pytest.approx(1.0)


@pytest.mark.parametrize("metric", LOCAL_METRICS)
async def test_disjoint_texts_score_0(context: GraderContext, metric: str) -> None:
    assert await score(context, metric, "alpha beta gamma delta", "one two three four") == pytest.approx(
        0.0, abs=0.35
    )
    if metric != "fuzzy_match":  # WRatio gives a little credit for shared letters
        assert await score(context, metric, "alpha beta gamma delta", "one two three four") == 0.0


@pytest.mark.parametrize("metric", LOCAL_METRICS)
@pytest.mark.parametrize(
    ("answer", "reference", "expected"),
    [("", "", 1.0), ("", "Paris", 0.0), ("Paris", "", 0.0), ("  ", "x", 0.0)],
)
async def test_empty_texts(
    context: GraderContext, metric: str, answer: str, reference: str, expected: float
) -> None:
    assert await score(context, metric, answer, reference) == expected


@pytest.mark.parametrize(
    ("metric", "answer", "reference", "expected"),
    [
        # fuzzy_match: rapidfuzz WRatio on lower-cased text without punctuation, / 100
        ("fuzzy_match", "Hello World", "hello world", 1.0),
        ("fuzzy_match", "Hello, World!", "hello world", fuzz.WRatio("hello  world", "hello world") / 100),
        (
            "fuzzy_match",
            "kitten",
            "sitting",
            fuzz.WRatio("kitten", "sitting", processor=utils.default_process) / 100,
        ),
        # ROUGE F-measures on words: 2 of 3 unigrams, 1 of 2 bigrams, 0 of 1 trigram, LCS of 2
        ("rouge_1", "the cat sat", "the cat ate", 2 / 3),
        ("rouge_2", "the cat sat", "the cat ate", 0.5),
        ("rouge_3", "the cat sat", "the cat ate", 0.0),
        ("rouge_l", "the cat sat", "the cat ate", 2 / 3),
        ("rouge_l", "cat the", "the cat", 0.5),
        # ROUGE sees letters of every script (rouge-score's own tokenizer would drop them)
        ("rouge_1", "Café crème brûlée", "café crème brûlée", 1.0),
        ("rouge_1", "東京 大阪", "東京 京都", 0.5),
        # BLEU-4 with smoothing; GLEU
        ("bleu", "the cat sat on the mat", "the cat is on the mat", 0.2541),
        ("bleu", "the cat", "the cat", 1.0),
        ("gleu", "the cat sat on the mat", "the cat is on the mat", 0.5),
    ],
)
async def test_known_values(
    context: GraderContext, metric: str, answer: str, reference: str, expected: float
) -> None:
    assert await score(context, metric, answer, reference) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("metric", LOCAL_METRICS)
async def test_closer_answers_score_higher(context: GraderContext, metric: str) -> None:
    reference = "the order W123 was cancelled and refunded to the original card"
    close = await score(context, metric, "the order W123 was cancelled and refunded to the card", reference)
    far = await score(context, metric, "I could not find any order for you today sorry", reference)
    assert 0.0 <= far < close <= 1.0


async def test_long_texts_are_scored_off_the_event_loop_and_capped(context: GraderContext) -> None:
    text = " ".join(f"word{i % 97}" for i in range(6000))  # over the thread threshold and MAX_TOKENS
    assert await score(context, "rouge_l", text, text) == pytest.approx(1.0)
    assert await score(context, "bleu", text, text) == pytest.approx(1.0)


async def test_meteor_is_refused_without_wordnet(
    context: GraderContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(similarity, "wordnet_available", lambda: False)
    with pytest.raises(MetricUnavailable, match="WordNet"):
        local_metric("meteor")
    with pytest.raises(GraderConfigError) as caught:
        build_graders({"similar": config("meteor")}, source="graders.yaml", context=context)
    assert caught.value.field == "evaluation_metric"
    assert caught.value.grader == "similar"
    assert "nltk.downloader wordnet" in str(caught.value)


async def test_meteor_is_served_when_wordnet_is_there(
    context: GraderContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(similarity, "wordnet_available", lambda: True)
    grader = build_graders({"similar": config("meteor")}, source="test", context=context)["similar"]
    assert grader.version


class NoSynonyms:
    """A WordNet with no synsets: METEOR then matches exact words and stems only."""

    def synsets(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []


def test_meteor_values() -> None:
    wordnet = NoSynonyms()
    same = meteor("the cat sat on the mat", "the cat sat on the mat", wordnet=wordnet)
    close = meteor(
        "the cats sat on a mat", "the cat sat on the mat", wordnet=wordnet
    )  # "cats" stems to "cat"
    far = meteor("dogs run fast", "the cat sat on the mat", wordnet=wordnet)
    assert same == pytest.approx(0.9977, abs=1e-3)
    assert 0.0 == far < close < same
    assert meteor("", "the cat", wordnet=wordnet) == 0.0


def test_fuzzy_match_compares_the_first_characters_of_long_texts() -> None:
    """WRatio's partial matching of texts of unlike lengths grows with the product of the two: a long
    answer is compared by its first FUZZY_MAX_CHARS characters, as its reference is."""
    limit = similarity.FUZZY_MAX_CHARS
    reference = "a" * limit
    padded = reference + "b" * 200  # past the cut: not compared
    assert similarity.fuzzy_match(padded, reference) == 1.0
    assert fuzz.WRatio(padded, reference, processor=utils.default_process) < 100  # the uncut texts differ
    assert similarity.fuzzy_match("b" + padded, reference) < 1.0  # within the cut: compared
