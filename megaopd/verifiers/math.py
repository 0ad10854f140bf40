"""Math verifier: pull the final answer out of a response and decide whether it equals the reference.

Extraction, in the order datasets expect it: the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces are
balanced), GSM8K's ``#### N``, a final-answer line ("The final answer is 42", "Answer: 42"), and the last number in
the text as a fallback.

Equivalence, cheapest first: equal normalised strings (LaTeX spacing, ``\\dfrac``, ``\\left``, ``\\text{units}``,
degrees, dollar signs, thousands separators stripped); equal exact rationals (fractions, decimals, percentages, so
``1/2``, ``\\frac12``, ``0.5`` and ``50\\%`` agree); ``math-verify``'s LaTeX grammar; and ``simplify(a - b) == 0`` on
answers written as code-like expressions (``sqrt(2)/2``), parsed by our own grammar (``expr``). Nothing here
evaluates model text as Python (no sympify, parse_expr or eval), so a worker only ever parses. The last two run
in a small pool of worker processes (``killable``) with a hard wall-clock limit (``extra_info["timeout_s"]``, default
5 s): a check past it is killed with its worker and scores 0, from any thread and however loaded the machine is.

``ground_truth`` is the reference answer (a string or number), or a list of acceptable answers.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Any

from megaopd.data.answers import last_boxed
from megaopd.verifiers import expr, register
from megaopd.verifiers.killable import CallTimeout, KillablePool

# math-verify warns on every call that we disabled its signal-based timeouts; the worker's kill is the deadline.
logging.getLogger("math_verify").setLevel(logging.ERROR)

DEFAULT_TIMEOUT_S = 5.0


# The slow checks run in killable worker processes: a hard wall-clock limit, from any thread, under any load.
_pool = KillablePool("megaopd.verifiers.math:slow_equal", size=2)


# ----------------------------------------------------------------------------------------------- extraction

# Possessive whitespace (*+) and same-line ^[ \t]: these run on model output in the trainer's process, where a
# backtracking \s* took minutes on a response of blank lines.
_GSM8K = re.compile(r"####\s*+([^\n]+)")
_FINAL = re.compile(r"(?:final answer|the answer)\s*+(?:is|:)?\s*+[:=]?\s*+(.+)|^[ \t]*+\**answer\**\s*+[:=]\s*+(.+)",
                    re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    gsm = _GSM8K.findall(text)
    if gsm:
        return gsm[-1].strip()
    finals = _FINAL.findall(text)
    if finals:
        answer = next(group for group in finals[-1] if group).strip()
        inner = last_boxed(answer)
        return (inner if inner is not None else answer).rstrip(". ").strip("$ ")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# ----------------------------------------------------------------------------------------------- normalisation

_UNIT_WORDS = ("dollars", "dollar", "cents", "cent", "units", "unit", "degrees", "degree", "percent", "inches",
               "inch", "feet", "foot", "meters", "meter", "cm", "mm", "km", "m", "kg", "g", "hours", "hour",
               "minutes", "minute", "seconds", "second", "days", "day", "miles", "mile", "sq", "square")
_TRAILING_UNIT = re.compile(r"(?<=[\d}])\s*(?:" + "|".join(_UNIT_WORDS) + r")(?:\^?\{?[23]\}?)?\.?$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\{([^{}]*)\}")


def normalize(answer: str) -> str:
    """A canonical spelling of an answer, for string comparison and number parsing."""
    s = str(answer).strip()
    s = re.sub(r"\\text\{\s*(?:" + "|".join(_UNIT_WORDS) + r")\s*\}", "", s)  # \text{ cm} is a unit: drop it
    s = _TEXT.sub(r"\1", s)
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", ""),
                     ("\\,", ""), ("\\;", ""), ("\\ ", ""), ("\\$", ""), ("$", ""), ("\\%", "%"),
                     ("^\\circ", ""), ("^{\\circ}", ""), ("°", "")):
        s = s.replace(old, new)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5"
    s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)  # 1,000 -> 1000 (twice for 1,000,000)
    s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)
    s = _TRAILING_UNIT.sub("", s.strip())
    s = s.strip().rstrip(".").replace(" ", "")
    return s


_FRAC = re.compile(r"^(-?)\\frac\{?(-?\d+)\}?\{?(-?\d+)\}?$")


_MAX_EXPONENT = 1000


def to_number(answer: str) -> tuple[Fraction, bool] | None:
    """An exact rational and whether it was a percentage, for normalised answers like 0.5, -3/4, \\frac{1}{2}, 50%."""
    s = answer
    percent = s.endswith("%")
    s = s.rstrip("%")
    frac = _FRAC.match(s)
    try:
        if frac:
            value = Fraction(int(frac.group(2)), int(frac.group(3)))
            return (-value if frac.group(1) else value), percent
        number = re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)(/\d+)?|-?\d+(\.\d+)?e(-?\d+)", s)
        # An exponent is bounded: Fraction("1e999999999") would build a billion-digit integer in this process.
        if number and (number.group(5) is None or abs(int(number.group(5)[:6])) <= _MAX_EXPONENT):
            return Fraction(s), percent
    except (ValueError, ZeroDivisionError):
        pass
    return None


def _numbers_equal(pred: str, gold: str) -> bool | None:
    """True/False when both are numbers, None when either is not. A percentage matches its value and value/100."""
    a, b = to_number(pred), to_number(gold)
    if a is None or b is None:
        return None
    (x, x_pct), (y, y_pct) = a, b
    if x == y:
        return True
    return (x_pct and x / 100 == y) or (y_pct and y / 100 == x)


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import LatexExtractionConfig, parse, verify

    def as_latex(s: str) -> str:
        return s if "$" in s or "\\boxed" in s else f"${s}$"

    # LaTeX only: math-verify's expression extraction (its default second target) hands text to sympy's
    # parse_expr, which evaluates Python; code-like answers go through our grammar (``expr``) instead.
    latex_only = [LatexExtractionConfig()]
    gold_parsed = parse(as_latex(gold), latex_only, parsing_timeout=None)
    pred_parsed = parse(as_latex(pred), latex_only, parsing_timeout=None)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _sympy_equal(pred: str, gold: str) -> bool:
    import sympy

    try:
        return bool(sympy.simplify(expr.parse(pred) - expr.parse(gold)) == 0)
    except (expr.Refused, TypeError, ValueError, ArithmeticError):
        return False


def is_equivalent(pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether two final answers are mathematically the same; False when the check runs past ``timeout_s``."""
    p, g = normalize(pred), normalize(gold)
    if not p:
        return False
    if p == g:
        return True
    numeric = _numbers_equal(p, g)
    if numeric is not None:
        return numeric
    try:
        return _pool.call([pred, gold, p, g], timeout_s)
    except CallTimeout:
        return False


def slow_equal(pred: str, gold: str, pred_normalized: str, gold_normalized: str) -> bool:
    """math-verify, then sympy; runs in a worker process (see ``_pool``)."""
    return _math_verify_equal(pred, gold) or _sympy_equal(pred_normalized, gold_normalized)


@register("math", "openai/gsm8k", "gsm8k", "DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH",
          "hendrycks/competition_math", "HuggingFaceH4/MATH-500", "math500", "math_dapo",
          "BytedTsinghua-SIA/DAPO-Math-17k", "agentica-org/DeepScaleR-Preview-Dataset", "deepscaler", "aime",
          "AI-MO/aimo-validation-aime",
          "Maxwell-Jia/AIME_2024", "math-ai/aime25")
def score_math(response: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the response's final answer equals the reference (or one of a list of references), else 0.0."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    timeout_s = float((extra_info or {}).get("timeout_s", DEFAULT_TIMEOUT_S))
    return float(any(is_equivalent(answer, str(gold), timeout_s) for gold in golds))
