"""Instruction-following verifier (IFEval layout): the score of a response against a row's instructions.

The score is 1.0 when every instruction is followed (IFEval's strict prompt-level accuracy); with
``extra_info["partial_credit"]`` it is the fraction followed (instruction-level accuracy). The instructions, their
ground-truth layout and their checks live in ``megaopd.data.instructions``, shared with the IFEval converter.
"""

from __future__ import annotations

from typing import Any

from megaopd.data.instructions import followed
from megaopd.verifiers import register


@register("instruction_following", "ifeval", "google/IFEval")
def score_instructions(response: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when all instructions are followed; the fraction followed with ``partial_credit``."""
    results = followed(response, ground_truth)
    if (extra_info or {}).get("partial_credit"):
        return sum(results) / len(results) if results else 1.0
    return float(all(results))
