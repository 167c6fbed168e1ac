"""`python -m bench.grader_batch`: wall time of one reward batch of math_answer samples (the grader pool's cost).

Six answer shapes in turn (LaTeX fractions and roots, a plain number, a polynomial, pi, a wrong
answer), ``--n`` samples a batch; one warm-up batch (imports, the pool's start), then ``--reps`` batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SHAPES = [
    ("so \\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\frac{1}{\\sqrt{4}}}", "1/2"),
    ("the answer is 42", "42"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{3\\pi}", "3\\pi"),
    ("\\boxed{2}", "3"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from gspo_core.rewards import build_reward

    texts = [SHAPES[i % len(SHAPES)] for i in range(args.n)]
    samples = [{"output_text": t, "output_tokens": len(t), "finish_reason": "stop"} for t, _ in texts]
    items = [{"answer": a} for _, a in texts]
    t0 = time.perf_counter()
    fn = build_reward({"type": "math_answer", "reference": "{{item.answer}}"})
    fn.score_batch(items, samples)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        res = fn.score_batch(items, samples)
        times.append(time.perf_counter() - t0)
    fn.close()
    print(
        json.dumps(
            {
                "n": args.n,
                "first_batch_s": round(first, 3),
                "batch_s": [round(t, 3) for t in times],
                "median_s": round(statistics.median(times), 3),
                "mean_reward": round(sum(r.reward for r in res) / len(res), 4),
                "errors": sum(bool(r.errors) for r in res),
            }
        )
    )


if __name__ == "__main__":
    main()
