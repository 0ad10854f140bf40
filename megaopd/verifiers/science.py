"""Science multiple-choice verifier (GPQA, SciQ, MMLU, MMLU-Pro, ARC-style): the response must name the right letter.

``ground_truth`` is the correct option's letter ("A".."J"). ``extra_info["num_choices"]``, when present, bounds
the letters a response may name (a "E" to a four-option question is no answer).

The letter is taken, in order, from the last ``\\boxed{B}`` (or ``\\boxed{\\text{(B)}}``), the last "answer is (B)" /
"Answer: B" phrase, a response that is just a letter ("B", "(B)", "B."), and finally the last "(B)" in the text. A
response that hedges across several letters in its final phrase gets the last one, like a grader reading the end.
"""

from __future__ import annotations

import re
from typing import Any

from megaopd.data.answers import LETTERS
from megaopd.verifiers import register

# The letters a response marks as its answer, best first; ``_PATTERNS`` adds the last "(B)" anywhere.
_MARKED = (
    # the explanation after the letter stops at the next \boxed: "\boxed{A." repeated without a "}" took 11 s
    re.compile(r"\\boxed\{\s*+(?:\\(?:text|textbf|mathrm)\{\s*+)?"
               r"\(?([A-J])\)?\s*+(?:[:.)](?:(?!\\boxed)[^}])*+)?\}"),
    # only the word "answer" is case-insensitive: in "the answer is a ..." the article is no choice
    # possessive runs (*+): with backtracking, "answer" and 8,000 spaces took 19 s in the trainer's process
    re.compile(r"(?i:answer)[*_\s]*+(?:is|:)?[*_\s:=]*+(?:option\s*+)?[$\\{(]*+([A-J])\b(?![a-zA-Z])"),
    re.compile(r"^\s*\(?([A-Ja-j])\)?[.:]?\s*$"),
)
_PATTERNS = (*_MARKED, re.compile(r"\(([A-J])\)"))


def extract_choice(text: str, num_choices: int = len(LETTERS), marked: bool = False) -> str | None:
    """The letter a response chooses, or None when it names none within the first ``num_choices`` letters; with
    ``marked``, only a letter it marks as its answer (boxed, after "answer", or alone), not a "(B)" anywhere."""
    allowed = LETTERS[:num_choices]
    for pattern in _MARKED if marked else _PATTERNS:
        found = [m.upper() for m in pattern.findall(text)]
        if found:
            return found[-1] if found[-1] in allowed else None
    return None


@register("science", "multiple_choice", "gpqa", "Idavidrein/gpqa", "sciq", "allenai/sciq", "mmlu", "cais/mmlu",
          "mmlu_pro", "TIGER-Lab/MMLU-Pro", "arc", "allenai/ai2_arc")
def score_choice(response: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the chosen letter is the ground truth, else 0.0."""
    num_choices = int((extra_info or {}).get("num_choices", len(LETTERS)))
    return float(extract_choice(response, num_choices) == str(ground_truth).strip().upper())
