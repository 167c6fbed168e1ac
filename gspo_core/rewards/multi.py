"""The `multi` grader: a safe arithmetic formula over named sub-graders (e.g. 0.8*correct + 0.2*fmt)."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import cast

from gspo_core.rewards.base import MAX_SPEC_NUMBER, Grader, GraderError, RewardSpecError, build_grader, register
from gspo_core.rewards.policy import DEFAULT_POLICY

_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_FUNCS: dict[str, Callable[..., float]] = {"min": min, "max": max, "abs": abs}
#: Bounds checked before anything recurses: multi graders nested in multi graders, sub-graders per
#: multi, and the formula's syntax tree (nesting depth, nodes).
MAX_MULTI_DEPTH = 8
MAX_SUB_GRADERS = 64
MAX_FORMULA_DEPTH = 100
MAX_FORMULA_NODES = 1000


def _tree_size(tree: ast.AST) -> tuple[int, int]:
    """(depth, nodes) of a syntax tree, computed without recursion."""
    depth = nodes = 0
    stack = [(tree, 1)]
    while stack:
        node, d = stack.pop()
        nodes, depth = nodes + 1, max(depth, d)
        stack.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return depth, nodes


def _check(node: ast.AST, names: set[str], field: str) -> None:
    """Allow numbers, sub-grader names, + - * / **, unary minus, min/max/abs calls only."""
    if isinstance(node, ast.Expression):
        return _check(node.body, names, field)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if not abs(node.value) <= MAX_SPEC_NUMBER:  # 1e400 parses as inf; a 400-digit integer overflows a float
            raise RewardSpecError(field, f"{ast.unparse(node)[:40]}: numbers are at most {MAX_SPEC_NUMBER:g}")
        return
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise RewardSpecError(field, f"unknown name {node.id!r}; sub-graders are {', '.join(sorted(names))}")
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        _check(node.left, names, field)
        return _check(node.right, names, field)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _check(node.operand, names, field)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCS
        and not node.keywords
        and node.args
    ):
        for arg in node.args:
            _check(arg, names, field)
        return
    raise RewardSpecError(field, f"unsupported expression {ast.unparse(node)!r}")


def _eval(node: ast.AST, env: dict[str, float]) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant):
        return float(cast(float, node.value))  # a number: _check lets no other constant through
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp):
        return _BIN[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, env)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return _FUNCS[node.func.id](*(_eval(arg, env) for arg in node.args))
    raise TypeError(f"not a formula node: {ast.dump(node)[:200]}")  # _check lets no other node through


@register("multi")
class MultiGrader(Grader):
    """Combines ``graders`` (name -> spec) with ``calculate_output`` (default: their mean).

    At the top level the reward function scores the sub-graders itself (concurrently) and calls
    :meth:`combine`; ``grade`` is only used for a multi nested inside a multi."""

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"graders", "calculate_output"})
        subs = self.req("graders", dict)
        if not subs:
            raise RewardSpecError(self.field("graders"), "needs at least one sub-grader")
        if len(subs) > MAX_SUB_GRADERS:
            raise RewardSpecError(self.field("graders"), f"more than {MAX_SUB_GRADERS} sub-graders")
        if self.path and len(self.path.split(".")) // 2 >= MAX_MULTI_DEPTH:  # each level adds "graders.<name>"
            raise RewardSpecError(self.field("graders"), f"multi graders nested deeper than {MAX_MULTI_DEPTH} levels")
        self.subs: dict[str, Grader] = {}
        for name, sub in subs.items():
            if not name.isidentifier():
                raise RewardSpecError(self.field(f"graders.{name}"), "sub-grader names must be identifiers")
            grader = build_grader(sub, self.field(f"graders.{name}"), policy)
            grader.name = name
            self.subs[name] = grader
        mean = "(" + " + ".join(self.subs) + f") / {len(self.subs)}"
        formula = self.opt("calculate_output", str, mean)
        if len(formula) > 2000:
            raise RewardSpecError(self.field("calculate_output"), "longer than 2000 characters")
        try:
            self.tree = ast.parse(formula, mode="eval")
        except (SyntaxError, ValueError) as exc:
            raise RewardSpecError(
                self.field("calculate_output"), f"not a formula: {getattr(exc, 'msg', exc)}"
            ) from None
        except (RecursionError, MemoryError):
            raise RewardSpecError(self.field("calculate_output"), "nested too deeply") from None
        depth, nodes = _tree_size(self.tree)
        if depth > MAX_FORMULA_DEPTH or nodes > MAX_FORMULA_NODES:
            raise RewardSpecError(
                self.field("calculate_output"),
                f"more than {MAX_FORMULA_NODES} terms or nested deeper than {MAX_FORMULA_DEPTH} levels",
            )
        _check(self.tree, set(self.subs), self.field("calculate_output"))

    def local_models(self) -> dict[str, str]:
        return {k: v for sub in self.subs.values() for k, v in sub.local_models().items()}

    def combine(self, scores: dict[str, float]) -> float:
        try:
            out = float(_eval(self.tree, scores))
        except (ZeroDivisionError, OverflowError, ValueError, TypeError) as exc:
            raise GraderError("invalid_output", f"formula failed: {exc}") from None
        if not math.isfinite(out):
            raise GraderError("invalid_output", f"formula gave {out}")
        return out

    def grade(self, sample, item):  # only used when a multi is nested inside a multi
        scores = {}
        for name, grader in self.subs.items():
            res = grader.grade_batch([sample], [item])[0] if grader.batched else grader.grade_one(sample, item)
            if isinstance(res, GraderError):
                raise res
            scores[name] = res
        return self.combine(scores)

    def item_fields(self):
        return set().union(*(grader.item_fields() for grader in self.subs.values()))

    def close(self):
        for grader in self.subs.values():
            grader.close()
