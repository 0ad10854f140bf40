"""Hostile answers to the verifiers that parse text (issue 24): each scores 0, creates nothing on disk, leaves later
checks unchanged, stays within its limit, and is no verifier error (a policy must not be able to stop a run by
making its verifier fail).

Every math payload is a boxed "answer" that, evaluated as Python, would create a marker file or rewrite the
worker's sympy so that later wrong answers pass; on a verifier that evaluates model text (sympify, parse_expr) it
does both.
"""

import time
from pathlib import Path

import pytest

from megaopd.data.rows import Row
from megaopd.verifiers import score, verifier_errors
from megaopd.verifiers import expr
from megaopd.verifiers.math import is_equivalent, score_math

POISON = "__import__('sympy').__setattr__('simplify',[].count)"  # simplify(anything) == 0: everything equal


def payloads(marker: Path) -> dict[str, str]:
    """No spaces: the verifier's normalisation drops them before its last equivalence path."""
    mkdir = f"__import__('os').mkdir('{marker}')"
    return {
        "call": mkdir,
        "attribute chain": f"__import__('pathlib').Path('{marker}').touch()",
        "lambda": f"next(iter(lambda:{mkdir},0))",  # iter(f, sentinel) calls f with no arguments
        "dunder": f"__import__('builtins').__dict__['open']('{marker}','w')",
        "string": f"open('{marker}','w')",
        "subscript": f"[{mkdir}][0]",
        "poison": POISON,
    }


def errors() -> int:
    return sum(verifier_errors().values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["call", "attribute chain", "lambda", "dunder", "string", "subscript", "poison"])
def test_hostile_math_answers_run_nothing(kind, tmp_path):
    marker = tmp_path / "pwned"
    answer = payloads(marker)[kind]
    before = errors()
    for gold in ("1", "x", answer):  # a number, an expression, and the payload itself as the reference
        assert score_math(f"The answer is \\boxed{{{answer}}}", gold, {}) == (1.0 if gold == answer else 0.0)
        for _ in range(3):  # the pool reuses its workers: a poisoned one would answer the next check
            is_equivalent(answer, "x")
    assert not marker.exists()
    assert not is_equivalent("x^2", "x^3") and not is_equivalent("sqrt(2)", "2")  # later checks unchanged
    assert is_equivalent("sqrt(2)/2", "1/sqrt(2)")
    assert errors() == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("answer", ["9**9**9**9", "9^{9^{9^{9}}}", "(x+1)^(10^8)", "(" * 5000 + "1" + ")" * 5000,
                                    "1+" * 100_000 + "1"])
def test_huge_and_deep_math_answers_are_refused_within_the_limit(answer):
    is_equivalent("x", "y")  # a started worker: its start-up (imports) is not part of a check's limit
    start = time.monotonic()
    assert score_math(f"\\boxed{{{answer}}}", "7", {"timeout_s": 2}) == 0.0
    assert time.monotonic() - start < 8  # the killable worker's limit, with room for a loaded machine


def test_the_grammar_refuses_code_and_builds_math():
    for code in ("__import__('os')", "a.b", "x[0]", "lambda: 1", "'s'", "print(x)", "x_1", "1,2", "x=1", "3!"):
        with pytest.raises(expr.Refused):
            expr.parse(code)
    assert str(expr.parse("3x^2 + 2(x-1) - sqrt 4")) == "3*x**2 + 2*x - 4"
    assert expr.parse("2^3^2") == 512  # right-associative, as in math
    with pytest.raises(expr.Refused):
        expr.parse("9^9^9^9")  # refused before sympy builds a 370-million-digit integer


HOSTILE_TEXTS = ["answer" + " " * 30_000 + "!", "\\boxed{A." * 4_000, "[" * 30_000, "<<" * 15_000, " \n" * 15_000,
                 "{" * 30_000, "[" * 100_000 + "]" * 100_000]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source, truth", [
    ("gpqa", "A"),
    ("ifeval", {"instruction_id_list": ["detectable_content:number_placeholders", "detectable_content:postscript",
                                        "detectable_format:number_bullet_lists", "detectable_format:title",
                                        "detectable_format:json_format"],
                "kwargs": [{"num_placeholders": 1}, {"postscript_marker": "P.S."}, {"num_bullets": 1}, {}, {}]}),
    ("arith_add", "42"),
])
def test_other_text_verifiers_stay_linear_and_never_error(source, truth):
    row = Row(source, [{"role": "user", "content": "?"}], truth)
    before = errors()
    for text in HOSTILE_TEXTS:
        start = time.monotonic()
        assert score(row, text) == 0.0
        assert time.monotonic() - start < 2, text[:20]  # in the trainer's own process: no backtracking blow-up
    assert errors() == before
