"""The slow half of a math check, run in a killable worker process (``megaopd.verifiers.math``): read both sides'
candidate answers into sympy and compare them as the reference grader (math-verify 0.9.0) does.

Each side is read as math-verify reads it: the first candidate that parses is the answer, and the first one's
normalised text stays beside it, so two answers that parse to nothing still agree when they are written the same.
LaTeX goes through math-verify's own normalisation (units, ``\\text{}``, ``\\left``, malformed ``\\frac12`` ...)
and its ANTLR grammar (latex2sympy2_extended); a number is built from its canonical digits; digit arithmetic and
code-like answers (``sqrt(2)/2``) go through our grammar (``expr``). None of it evaluates text as Python:
math-verify's expression target, which hands text to sympy's ``parse_expr``, is never called. The comparison is
math-verify's ``verify`` (numbers rounded to ``precision`` decimal places when one is a decimal, sets and
intervals with their ends, relations and equations, matrices, tuples), then, for code-like answers, whether our
grammar's two expressions simplify to the same value.

One reading of the LaTeX grammar is refused, because it pays wrong answers: numbers side by side (``2 3`` reads
as 5, ``1\\,000`` as 0); thousands grouped by threes are joined first. In plain
text a whole number before a proper fraction on the same line is a mixed number (``1 1/2`` is 3/2; ``11 7/6`` is
no answer; ``11`` and ``5/6`` on two lines are two numbers, never 71/6), and a percent after it applies to the
whole of it (``4 4/9 %`` is 2/45). An inequality of one variable (``x \\le 3``, ``-2 \\le x \\le 7``) is read as its
interval, from either side (the reference reads it so only as the reference answer), and a list of them with
disjoint solutions (``x<-2 \\text{ or } x>3``) as their union.
"""

from __future__ import annotations

import logging
import re

import sympy
from latex2sympy2_extended.latex2sympy2 import convert_to_pct, normalize_latex
from latex2sympy2_extended.sets import FiniteSet
from math_verify import verify
from math_verify.parser import LatexExtractionConfig, parse_latex_cached

from megaopd.verifiers import expr
from megaopd.verifiers.extract import MIXED_NUMBER, SCALES

# math-verify warns on every call that we disabled its signal-based timeouts; the worker's kill is the deadline.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_NORMALIZATION = LatexExtractionConfig().normalization_config
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\,|\\ |~|\{,\}|\s)\d{3})++(?![\d])")
_SIDE_BY_SIDE = re.compile(r"\d\s+\d")
# Spellings the grammar misreads, as ones it reads: sizing commands (\bigl( is a parenthesis), \degree, \varnothing
# (read as a symbol), an upright i or e (\mathrm{i} was dropped as a unit: 3+2\mathrm{i} read as 5), a residue's
# \pmod{9}, a scale word (2.5\text{ million} was 2.5 with a unit), a tie "~" (a space; "1~000" is joined first) and
# a closing period (``\sqrt{2}.``).
_SPELLINGS = ((re.compile(r"\\[bB]igg?[lrm]?(?![a-zA-Z])"), ""),
              (re.compile(r"\^\{\\degree\}|\^?\\degree(?![a-zA-Z])"), r"^{\\circ}"),
              (re.compile(r"\\varnothing(?![a-zA-Z])"), r"\\emptyset"),
              (re.compile(r"\\(?:mathrm|text|mathit|operatorname)\s*+\{\s*+([ie])\s*+\}"), r"\1"),
              (re.compile(r"\\pmod\s*+\{[^{}]*+\}"), ""),
              *((re.compile(rf"\\(?:text|mbox|mathrm)\{{\s*+{word}\s*+\}}"), rf"\\times 10^{{{power}}}")
                for word, power in SCALES.items()),
              (re.compile("~"), " "),
              (re.compile(r"(?<!\.)\.\s*+$"), ""))


def _latex(text: str) -> tuple[sympy.Basic | None, str]:
    shown = text
    try:
        text = _THOUSANDS.sub(lambda m: re.sub(r"\D", "", m.group()), text)
        for spelling, read_as in _SPELLINGS:
            text = spelling.sub(read_as, text)
        shown = normalize_latex(text, _NORMALIZATION)
        return (None if _SIDE_BY_SIDE.search(shown) else parse_latex_cached(shown)), shown
    except Exception:  # noqa: BLE001: text outside the grammar is no answer
        return None, shown


def _number(text: str) -> sympy.Number:
    """A canonical number: "-12", "0.5" or "3/4"."""
    if "/" in text:
        numerator, denominator = text.split("/")
        return sympy.Rational(int(numerator), int(denominator))
    return sympy.Float(text) if "." in text else sympy.Integer(int(text))


def _arithmetic(text: str) -> sympy.Basic | None:
    """Digit arithmetic through our grammar; a whole number before a proper fraction is a mixed number."""
    mixed = MIXED_NUMBER.fullmatch(text)
    if mixed:
        whole, numerator, denominator = (int(g) for g in mixed.group(2, 3, 4))
        if numerator < denominator:
            value = whole + sympy.Rational(numerator, denominator)
            return -value if mixed.group(1) else value
    try:
        return expr.parse(text.replace("×", "*").replace("÷", "/"))
    except (expr.Refused, TypeError, ValueError, ArithmeticError):
        return None


_ORDER = (sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge)


def _as_interval(value: sympy.Basic) -> sympy.Set | None:
    """The interval (or union of intervals) of numbers an inequality of one variable states (``x \\le 3``,
    ``-2 \\le x \\le 7``), or None for anything else."""
    chained = isinstance(value, sympy.And) and len(value.args) == 2 and all(isinstance(a, _ORDER) for a in value.args)
    if not (chained or isinstance(value, _ORDER)) or len(value.free_symbols) != 1:
        return None
    try:
        solution = value.as_set()
    except Exception:  # noqa: BLE001: what sympy cannot solve stays a relation
        return None
    pieces = solution.args if isinstance(solution, sympy.Union) else (solution,)
    if not all(isinstance(p, sympy.Interval) and p.start.is_number and p.end.is_number for p in pieces):
        return None
    return solution


def _interval(value: sympy.Basic) -> sympy.Basic:
    """An inequality of one variable (``x \\le 3``, ``-2 \\le x \\le 7``) as the interval it states, so it meets
    ``x \\in [-2,7]`` or ``[-2,7]`` from either side (the reference reads it so only as the reference answer, and
    only when chained); a list of inequalities of one variable with disjoint solutions (``x<-2 \\text{ or } x>3``:
    read as "or", since "and" would state no number) as their union; anything else as it is."""
    if isinstance(value, FiniteSet) and len(value.args) > 1:
        pieces = [_as_interval(arg) for arg in value.args]
        if None in pieces or len(set().union(*(arg.free_symbols for arg in value.args))) != 1:
            return value
        if any(a.intersect(b) != sympy.S.EmptySet for i, a in enumerate(pieces) for b in pieces[i + 1:]):
            return value
        return sympy.Union(*pieces)
    return _as_interval(value) or value


def _part(kind: str, text: str, percent: bool) -> tuple[sympy.Basic | None, str]:
    """One part as sympy (None when it does not parse) and as text."""
    if len(text) > expr.MAX_LENGTH:
        return None, text
    if kind == "latex":
        value, shown = _latex(text)
    elif kind == "number":
        value, shown = _number(text), text
    else:
        value, shown = _arithmetic(text), text
    if value is not None and percent:
        value = convert_to_pct(value)
    return (_interval(value) if value is not None else None), shown


def _candidate(parts: list) -> tuple[sympy.Basic | None, str]:
    """Several parts are a set when all parse (math-verify's reading of "$1$, $2$ and $3$"), else the first."""
    read = [_part(*part) for part in parts]
    values = [value for value, _ in read]
    if len(read) > 1 and all(value is not None for value in values):
        members = [m for value in values for m in (value.args if isinstance(value, FiniteSet) else (value,))]
        try:
            return FiniteSet(*members), " and ".join(shown for _, shown in read)
        except Exception:  # noqa: BLE001: members sympy cannot put in one set are no set answer
            pass
    return read[0]


def _read(candidates: list) -> list:
    """math-verify's reading of a side: the first candidate that parses, then the first candidate's text."""
    shown_first = None
    for parts in candidates:
        value, shown = _candidate(parts)
        shown_first = shown if shown_first is None else shown_first
        if value is not None:
            return [value, shown_first]
    return [shown_first] if shown_first else []


def _code_like_equal(pred: list, gold: list) -> bool:
    """Whether two one-part answers written as code (``sqrt(2)/2``, ``x**2+1``) simplify to the same value."""
    if len(pred) != 1 or len(gold) != 1 or "\\" in pred[0][1] + gold[0][1]:
        return False
    try:
        return bool(sympy.simplify(expr.parse(pred[0][1]) - expr.parse(gold[0][1])) == 0)
    except Exception:  # noqa: BLE001: whatever sympy raises on a hostile expression, it is no match
        return False


def grade(pred: list, gold: list, precision: int) -> bool:
    """Whether the predicted candidates (``[[kind, text, percent], ...]`` each) state the reference's answer."""
    if not pred or not gold:
        return False
    if verify(_read(gold), _read(pred), float_rounding=precision, timeout_seconds=None):
        return True
    return _code_like_equal(pred[0], gold[0])
