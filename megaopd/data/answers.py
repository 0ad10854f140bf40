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

# Multiple-choice options in order: a science row's ground truth is one of these letters.
LETTERS = "ABCDEFGHIJ"


# LaTeX's math delimiters, each opening to its closing, and the commands that box an answer: spelled here once for
# the extractor and the math verifier (``megaopd.verifiers.extract``, ``megaopd.verifiers.math``).
LATEX_DELIMITERS = {"$": "$", "$$": "$$", "\\(": "\\)", "\\[": "\\]"}
BOX_COMMANDS = ("boxed", "fbox")
BOX = re.compile(r"\\(?:" + "|".join(BOX_COMMANDS) + ")")
_BOX_SEPARATOR = re.compile(r"\b(?:and|or)\b|,|;")


def _braced(text: str, open_at: int, limit: int) -> int | None:
    """Index of the brace closing the one at ``open_at``, before ``limit``."""
    depth = 0
    for i in range(open_at, limit):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return None


def boxed_answer(text: str) -> str | None:
    """The answer a text boxes: its last ``\\boxed{}`` / ``\\fbox{}`` (or ``\\boxed 5``), with earlier boxes
    written next to it (fewer than 10 characters apart, or under 70 with "and", "or", "," or ";" between) joined
    by commas, as the reference reads several boxes; None when there is no box or the last one is cut off."""
    boxes = list(BOX.finditer(text))
    contents: list[str] = []
    limit, later_start = len(text), None
    for box in reversed(boxes):
        brace = box.end()
        while brace < limit and text[brace].isspace():
            brace += 1
        if brace < limit and text[brace] != "{":
            if not contents:  # "\boxed 5"
                token = re.match(r"[^\s$]+", text[brace:limit])
                contents.append(token.group() if token else "")
            break
        close = _braced(text, brace, limit) if brace < limit else None
        if close is None:
            break
        content = text[brace + 1:close].strip()
        if later_start is not None:
            between = text[close + 1:later_start]
            near = len(between) < 10 or (content != contents[-1] and len(between) < 70
                                         and _BOX_SEPARATOR.search(between))
            if not near:
                break
        if not contents or contents[-1] != content:
            contents.append(content)
        limit = later_start = box.start()
    contents = [c for c in contents if c]
    return ",".join(reversed(contents)) if contents else None


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
