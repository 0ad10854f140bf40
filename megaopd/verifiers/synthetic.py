"""Exact-answer verifier for the synthetic domains: the number after the last ``answer:`` must equal the truth."""

from __future__ import annotations

import re

from megaopd.data.synthetic import ANSWER_PREFIX, DOMAINS
from megaopd.verifiers import register

_ANSWER = re.compile(re.escape(ANSWER_PREFIX) + r"(-?\d+)")


def last_answer_number(response: str) -> str | None:
    """The integer written right after the last ``answer:`` (``ANSWER_PREFIX``), or None when there is none; not the
    math verifier's ``extract_answer`` (the reference grader's extraction order)."""
    matches = _ANSWER.findall(response)
    return matches[-1] if matches else None


@register(*DOMAINS)
def score_exact(response: str, ground_truth, extra_info: dict) -> float:
    answer = last_answer_number(response)
    # A trailing digit after the match would mean the model wrote a longer number: the regex is greedy, so
    # "answer:851" extracts 851, not 85.
    return float(answer is not None and answer == str(ground_truth))
