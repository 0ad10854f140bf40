"""How each domain writes its answers: a math answer in ``\\boxed{}``, a multiple-choice option as a letter, a code
row's tests in one of the layouts that ``megaopd.verifiers.code`` documents.

One home for both sides: the dataset converters (``megaopd.data.sources``) build and check ground truths with these
functions and the verifiers read responses and ground truths with the same ones, so a row that loads is a row that
can be scored.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")

# Multiple-choice options in order: a science row's ground truth is one of these letters.
LETTERS = "ABCDEFGHIJ"


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox, or \\boxed 5), with nested braces balanced."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    if start >= len(text):
        return None
    if text[start] != "{":  # "\boxed 5"
        token = re.match(r"[^\s$]+", text[start:])
        return token.group(0) if token else None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return None  # unbalanced: the response was cut off inside the box


def answer_letter(index: int) -> str:
    """The letter of a 0-based option index."""
    if not 0 <= index < len(LETTERS):
        raise ValueError(f"option index {index} is out of range 0..{len(LETTERS) - 1}")
    return LETTERS[index]


def parse_tests(ground_truth: Any) -> dict:
    """The ground truth as a dict of one of the documented layouts; ValueError saying what is wrong otherwise."""
    spec = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(spec, dict):
        raise ValueError(f"code tests must be an object, got {type(spec).__name__}")
    if "test" in spec:
        if not spec.get("entry_point"):
            raise ValueError("HumanEval-style tests need 'entry_point' beside 'test'")
        return spec
    inputs, outputs = spec.get("inputs"), spec.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError("code tests need lists 'inputs' and 'outputs' (or 'test' + 'entry_point')")
    if len(inputs) != len(outputs):
        raise ValueError(f"code tests have {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("code tests are empty")
    if spec.get("fn_name"):
        if not all(isinstance(args, list) for args in inputs):
            raise ValueError("functional tests need each input to be a list of arguments")
    elif not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError("stdin/stdout tests need string inputs and outputs")
    return spec
