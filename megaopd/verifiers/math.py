"""Math verifier: find the final answer a response states and grade it as the reference grader (math-verify 0.9.0)
would, without evaluating any of it.

Extraction (``extract``) follows the reference's order: the last box, the answer sentence Minerva-style models
write, GSM8K's ``####``, "final answer is", "answer:", then (flexible extraction only) the last LaTeX span or
number. Each data source has its convention (``extra_info["extraction"]`` overrides it):

| data source | extraction | why |
|---|---|---|
| MATH, MATH-500, AIME, DeepScaleR, DAPO, ``math`` rows | flexible | the reference's own (lighteval, open-r1) |
| GSM8K (``openai/gsm8k``, ``gsm8k``) | strict | verl's default for GSM8K: only a marked answer counts |

A reference answer is read the same way when it holds LaTeX delimiters or a box, else as one answer on its own
(``\\frac{\\sqrt{2}}{2}``, ``1,000``, ``1,22`` with a decimal comma or as a pair: ``reference_readings``);
``ground_truth`` may be a list of acceptable answers.

Equivalence is the reference's (``math_grade``): two numbers compare here, in the caller's process (exactly, or
rounded to ``extra_info["precision"]`` decimal places, default 6, when one is a decimal); everything else runs in
a small pool of worker processes (``killable``) with a hard wall-clock limit (``extra_info["timeout_s"]``, default
5 s): a check past it is killed with its worker and scores 0, from any thread and however loaded the machine is.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from megaopd.data.answers import BOX_COMMANDS, LATEX_DELIMITERS
from megaopd.verifiers import register
from megaopd.verifiers.expr import MAX_LENGTH
from megaopd.verifiers.extract import FLEXIBLE, NUMBER, STRICT, Candidate, bare, candidates
from megaopd.verifiers.killable import CallTimeout, KillablePool
from megaopd.verifiers.science import extract_choice

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_PRECISION = 6  # decimal places a decimal answer is rounded to before it is compared (the reference's)

# The slow checks run in killable worker processes: a hard wall-clock limit, from any thread, under any load.
_pool = KillablePool("megaopd.verifiers.math_grade:grade", size=2)

_DELIMITERS = (*LATEX_DELIMITERS, *("\\" + command for command in BOX_COMMANDS))


def reference_readings(gold: str) -> list[list[Candidate]]:
    """A reference answer's readings, each as candidates; a response that states any of them is right. Extracted
    when it holds LaTeX delimiters or a box, else read on its own (an escaped ``\\$`` is a currency sign, no
    delimiter: MATH writes ``\\$32,\\!348``). On its own ``1,2`` reads two ways, both kept: a decimal comma, as
    the reference grader reads it, and the pair English data writes (the reference refuses ``\\boxed{1,2}``)."""
    unescaped = gold.replace("\\$", "")
    if any(d in unescaped for d in _DELIMITERS):
        return [candidates(gold)]
    readings = dict.fromkeys([bare(gold, decimal_comma=True), bare(gold)])
    return [[(part,)] for part in readings]


# A multiple-choice reference: an option letter, as "C", "(C)" or "\\text{(C)}".
_OPTION = re.compile(r"\$?\s*+(?:\\(?:text|textbf|mathrm)\{\s*+)?\(?([A-J])\)?\s*+\}?\s*+\$?")


def _chooses(response: str, gold: str) -> bool:
    """Whether a multiple-choice reference's letter is the one the response marks as its answer ("The answer is
    (C)", "Answer: C", ``\\boxed{C: 12}``), read as the science verifier reads it (never a "(C)" in passing)."""
    option = _OPTION.fullmatch(gold.strip())
    return option is not None and extract_choice(response, marked=True) == option[1]


def extract_answer(response: str, extraction: str = FLEXIBLE) -> str | None:
    """The text of the answer the reference grader's extraction order finds in a response (``extract.candidates``:
    the last box, the answer sentence, ``####``, ...; its first part), or None when it states none; not the synthetic
    verifier's ``last_answer_number``."""
    found = candidates(response, extraction)
    return found[0][0].text if found else None


def _numbers_agree(pred: Candidate, gold: Candidate, precision: int) -> bool | None:
    """The reference's grade of two numbers, or None when this cannot tell cheaply (two decimals within rounding
    of each other: the worker rounds as the reference does). Equal values agree, a percentage by its value (28% is
    0.28) and, as in the reference, by its number (28% and 28, 12.5% and 12.5)."""
    if len(pred) != 1 or len(gold) != 1 or pred[0].kind != NUMBER or gold[0].kind != NUMBER:
        return None
    (p,), (g,) = pred, gold
    if max(len(p.text), len(g.text)) > MAX_LENGTH:
        return None
    a, b = Fraction(p.text), Fraction(g.text)
    readings = {(a / 100 if p.percent else a, b / 100 if g.percent else b), (a, b)}
    if any(x == y for x, y in readings):
        return True
    if "." not in p.text + g.text or all(abs(x - y) >= Fraction(1, 10**precision) for x, y in readings):
        return False
    return None


def _wire(found: list[Candidate]) -> list:
    return [[[part.kind, part.text, part.percent] for part in candidate] for candidate in found]


def grade(pred: list[Candidate], gold: list[Candidate], precision: int = DEFAULT_PRECISION,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether the predicted candidates state the reference's answer; False when the check runs past
    ``timeout_s``."""
    if not pred or not gold:
        return False
    cheap = _numbers_agree(pred[0], gold[0], precision)
    if cheap is not None:
        return cheap
    try:
        return _pool.call([_wire(pred), _wire(gold), precision], timeout_s)
    except CallTimeout:
        return False


def is_equivalent(pred: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether two final answers, each written on its own, are the same."""
    return bool(pred.strip()) and grade([(bare(pred),)], [(bare(gold),)], timeout_s=timeout_s)


def _options(extra_info: dict, extraction: str) -> tuple[str, int, float]:
    extra_info = extra_info or {}
    extraction = extra_info.get("extraction", extraction)
    if extraction not in (STRICT, FLEXIBLE):
        raise ValueError(f"extra_info['extraction'] must be {STRICT!r} or {FLEXIBLE!r}, got {extraction!r}")
    precision = extra_info.get("precision", DEFAULT_PRECISION)
    if isinstance(precision, bool) or not isinstance(precision, int) or not 0 <= precision <= 15:
        raise ValueError(f"extra_info['precision'] must be a number of decimal places 0..15, got {precision!r}")
    return extraction, precision, float(extra_info.get("timeout_s", DEFAULT_TIMEOUT_S))


def _score(response: str, ground_truth: Any, extra_info: dict, extraction: str) -> float:
    extraction, precision, timeout_s = _options(extra_info, extraction)
    pred = candidates(response, extraction)
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return float(any(_chooses(response, str(gold)) or any(grade(pred, reading, precision, timeout_s)
                                                          for reading in reference_readings(str(gold)))
                     for gold in golds))


@register("math", "DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "hendrycks/competition_math",
          "HuggingFaceH4/MATH-500", "math500", "math_dapo", "BytedTsinghua-SIA/DAPO-Math-17k",
          "agentica-org/DeepScaleR-Preview-Dataset", "deepscaler", "aime", "AI-MO/aimo-validation-aime",
          "Maxwell-Jia/AIME_2024", "math-ai/aime25")
def score_math(response: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the response's answer equals the reference (or one of a list of references), else 0.0; flexible
    extraction unless the row says otherwise."""
    return _score(response, ground_truth, extra_info, FLEXIBLE)


@register("openai/gsm8k", "gsm8k")
def score_gsm8k(response: str, ground_truth: Any, extra_info: dict) -> float:
    """As ``score_math``, with strict extraction unless the row says otherwise."""
    return _score(response, ground_truth, extra_info, STRICT)
