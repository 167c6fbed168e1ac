"""Text-similarity metrics computed locally (no downloads): fuzzy match, exact, BLEU, GLEU, ROUGE-N/L."""

from __future__ import annotations

import difflib
import math
from collections import Counter


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def bleu(cand: str, ref: str, max_n: int = 4) -> float:
    """Sentence BLEU over whitespace tokens, add-one smoothing for n > 1 (Lin & Och 2004)."""
    c, r = cand.split(), ref.split()
    if not c or not r:
        return 0.0
    log_p = 0.0
    for n in range(1, max_n + 1):
        cn, rn = _ngrams(c, n), _ngrams(r, n)
        overlap = sum(min(v, rn[k]) for k, v in cn.items())
        if n == 1 and overlap == 0:
            return 0.0
        smooth = 1 if n > 1 else 0
        log_p += math.log((overlap + smooth) / (sum(cn.values()) + smooth))
    brevity = 1.0 if len(c) > len(r) else math.exp(1 - len(r) / len(c))
    return brevity * math.exp(log_p / max_n)


def gleu(cand: str, ref: str, max_n: int = 4) -> float:
    """Google-BLEU: min(precision, recall) over all 1..4-grams together (Wu et al. 2016)."""
    c, r = cand.split(), ref.split()
    cn, rn = Counter(), Counter()
    for n in range(1, max_n + 1):
        cn.update(_ngrams(c, n))
        rn.update(_ngrams(r, n))
    if not cn or not rn:
        return 0.0
    overlap = sum(min(v, rn[k]) for k, v in cn.items())
    return min(overlap / sum(cn.values()), overlap / sum(rn.values()))


def rouge_n(cand: str, ref: str, n: int) -> float:
    """ROUGE-N F1 over whitespace tokens."""
    cn, rn = _ngrams(cand.split(), n), _ngrams(ref.split(), n)
    overlap = sum(min(v, rn[k]) for k, v in cn.items())
    if not overlap:
        return 0.0
    p, rc = overlap / sum(cn.values()), overlap / sum(rn.values())
    return 2 * p * rc / (p + rc)


def rouge_l(cand: str, ref: str) -> float:
    """ROUGE-L F1 over whitespace tokens (longest common subsequence)."""
    c, r = cand.split(), ref.split()
    if not c or not r:
        return 0.0
    prev = [0] * (len(r) + 1)
    for x in c:
        cur = [0]
        for j, y in enumerate(r):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if not lcs:
        return 0.0
    p, rc = lcs / len(c), lcs / len(r)
    return 2 * p * rc / (p + rc)


#: OpenAI's ``evaluation_metric`` names that need no model or network, plus ``exact``.
#: (``meteor`` and ``cosine`` need WordNet / an embedding model and are not offered.)
METRICS = {
    "fuzzy_match": lambda a, b: difflib.SequenceMatcher(None, a, b, autojunk=False).ratio(),
    "exact": lambda a, b: float(a.strip() == b.strip()),
    "bleu": bleu,
    "gleu": gleu,
    "rouge_l": rouge_l,
    **{f"rouge_{n}": (lambda a, b, n=n: rouge_n(a, b, n)) for n in range(1, 6)},
}
