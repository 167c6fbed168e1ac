"""Text-similarity metrics computed locally (no downloads): fuzzy match, exact, BLEU, GLEU, ROUGE-N/L."""

from __future__ import annotations

import difflib
import functools
import math
from collections import Counter
from collections.abc import Callable


def _ngrams(tokens: list[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def bleu(cand: str, ref: str, max_n: int = 4) -> float:
    """Sentence BLEU over whitespace tokens, add-one smoothing for n > 1 (Lin & Och 2004)."""
    cand_tokens, ref_tokens = cand.split(), ref.split()
    if not cand_tokens or not ref_tokens:
        return 0.0
    log_p = 0.0
    for n in range(1, max_n + 1):
        cand_ngrams, ref_ngrams = _ngrams(cand_tokens, n), _ngrams(ref_tokens, n)
        overlap = sum(min(count, ref_ngrams[gram]) for gram, count in cand_ngrams.items())
        if n == 1 and overlap == 0:
            return 0.0
        smooth = 1 if n > 1 else 0
        log_p += math.log((overlap + smooth) / (sum(cand_ngrams.values()) + smooth))
    brevity = 1.0 if len(cand_tokens) > len(ref_tokens) else math.exp(1 - len(ref_tokens) / len(cand_tokens))
    return brevity * math.exp(log_p / max_n)


def gleu(cand: str, ref: str, max_n: int = 4) -> float:
    """Google-BLEU: min(precision, recall) over all 1..4-grams together (Wu et al. 2016)."""
    cand_tokens, ref_tokens = cand.split(), ref.split()
    cand_ngrams: Counter[tuple[str, ...]] = Counter()
    ref_ngrams: Counter[tuple[str, ...]] = Counter()
    for n in range(1, max_n + 1):
        cand_ngrams.update(_ngrams(cand_tokens, n))
        ref_ngrams.update(_ngrams(ref_tokens, n))
    if not cand_ngrams or not ref_ngrams:
        return 0.0
    overlap = sum(min(count, ref_ngrams[gram]) for gram, count in cand_ngrams.items())
    return min(overlap / sum(cand_ngrams.values()), overlap / sum(ref_ngrams.values()))


def rouge_n(cand: str, ref: str, n: int) -> float:
    """ROUGE-N F1 over whitespace tokens."""
    cand_ngrams, ref_ngrams = _ngrams(cand.split(), n), _ngrams(ref.split(), n)
    overlap = sum(min(count, ref_ngrams[gram]) for gram, count in cand_ngrams.items())
    if not overlap:
        return 0.0
    precision, recall = overlap / sum(cand_ngrams.values()), overlap / sum(ref_ngrams.values())
    return 2 * precision * recall / (precision + recall)


def rouge_l(cand: str, ref: str) -> float:
    """ROUGE-L F1 over whitespace tokens (longest common subsequence)."""
    cand_tokens, ref_tokens = cand.split(), ref.split()
    if not cand_tokens or not ref_tokens:
        return 0.0
    prev = [0] * (len(ref_tokens) + 1)
    for x in cand_tokens:
        cur = [0]
        for j, y in enumerate(ref_tokens):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if not lcs:
        return 0.0
    precision, recall = lcs / len(cand_tokens), lcs / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


#: OpenAI's ``evaluation_metric`` names that need no model or network, plus ``exact``.
#: (``meteor`` and ``cosine`` need WordNet / an embedding model and are not offered.)
METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": lambda a, b: difflib.SequenceMatcher(None, a, b, autojunk=False).ratio(),
    "exact": lambda a, b: float(a.strip() == b.strip()),
    "bleu": bleu,
    "gleu": gleu,
    "rouge_l": rouge_l,
    **{f"rouge_{n}": functools.partial(rouge_n, n=n) for n in range(1, 6)},
}
