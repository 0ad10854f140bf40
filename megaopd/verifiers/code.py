"""Code verifier: run the program in a response against a row's tests, inside the sandbox.

The program is the last fenced code block of the response (```python ... ```), or the whole response when it has no
fence but looks like code. ``ground_truth`` is one of these layouts (or a JSON string of one):

* stdin/stdout (APPS, TACO, CodeContests, LiveCodeBench "stdin")::

      {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}

  Output matches when equal line by line after trailing whitespace, or token by token: integers exactly, and a
  token within 1e-6 where the expected token is a float.
* functional (LeetCode, APPS/TACO with ``fn_name``, LiveCodeBench "functional")::

      {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], ...], "outputs": [[0, 1], ...]}

  Each entry of ``inputs`` is the list of positional arguments. The call goes to ``Solution().fn_name`` when the
  program defines ``class Solution`` (LeetCode starter code), else to the top-level function. The return value
  comes back as plain data (``wire``) and is compared here in its JSON view (tuples become lists): integers,
  strings and bools exactly, floats within 1e-6 only where the expected value is a float; an expected value
  wrapped in a one-element list, as TACO stores them, also matches.
* HumanEval::

      {"test": "def check(candidate): ...", "entry_point": "f", "prompt": "def f(x):\\n    \\"\\"\\"...\\"\\"\\"\\n"}

  ``prompt`` is prepended when the response only holds the function body. ``check`` never runs in the program's
  process: its assertions are split into calls judged here, or it runs in a trusted process that calls the
  program through pipes (``humaneval``).

The program's process never receives an expected value, and nothing it can read tells it whether it passed.
``extra_info`` options: ``partial_credit`` (score the fraction of tests passed; default all-or-nothing, which stops
at the first failure), ``time_limit_s`` (CPU seconds per test, default 4; wall clock is twice that plus one) and
``memory_mb`` (default 1024). Every test is a fresh sandboxed process (a HumanEval check is one, for all calls).
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import partial
from typing import Any, Callable, Sequence

from megaopd.data.answers import parse_tests
from megaopd.verifiers import guarded, register, wire
from megaopd.verifiers.humaneval import call_server, parse_replies, run_checker, run_split, split_check
from megaopd.verifiers.sandbox import Limits, default_workers, run_python

# Both scans are linear in the response: a backtracking regex over model output (a line of 20,000 fences, 20,000
# blank lines) took minutes in the trainer's process.
_LANG = re.compile(r"[ \t]*([\w+-]*)")
_CODE_HINT = re.compile(r"^[ \t]*(def |class |import |from \w+ import |print\(|for |while |if __name__)", re.MULTILINE)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each ```lang ... ``` block, in order."""
    blocks, pos = [], 0
    while (start := text.find("```", pos)) >= 0:
        newline = text.find("\n", start + 3)
        end = text.find("```", newline + 1) if newline >= 0 else -1
        if end < 0:
            break
        blocks.append((_LANG.match(text, start + 3, newline).group(1), text[newline + 1:end]))
        pos = end + 3
    return blocks


def extract_code(response: str) -> str | None:
    """The program in a response: the last Python (or unlabelled) fenced block, else the bare text if it is code."""
    blocks = [(lang.lower(), body) for lang, body in fenced_blocks(response)]
    python = [body for lang, body in blocks if lang in ("python", "python3", "py", "")]
    if python:
        return python[-1]
    if not blocks and _CODE_HINT.search(response):
        return response
    return None


# ----------------------------------------------------------------------------------------------- comparison
# Exact where the task is exact: integers and strings compare exactly, floats with a tolerance only when the
# expected value is a float (docs/verifiers.md states the rule).

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")


def _canonical_int(token: str) -> str:
    digits = token.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if token.startswith("-") and digits != "0" else digits


def _token_equal(got: str, want: str) -> bool:
    if got == want:
        return True
    if _INT.fullmatch(want):  # compared as text: exact at any size, no int conversion limit
        return bool(_INT.fullmatch(got)) and _canonical_int(got) == _canonical_int(want)
    if _FLOAT.fullmatch(want) and _FLOAT.fullmatch(got):
        return math.isclose(float(got), float(want), rel_tol=1e-6, abs_tol=1e-6)
    return False


def stdout_matches(got: str, want: str) -> bool:
    """Judge-style comparison: lines equal up to trailing whitespace, or tokens equal (integers exactly, floats
    within 1e-6 when the expected token is a float)."""
    def lines(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip("\n").split("\n")]

    if lines(got) == lines(want):
        return True
    got_tokens, want_tokens = got.split(), want.split()
    return len(got_tokens) == len(want_tokens) and all(map(_token_equal, got_tokens, want_tokens))


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, bool) or want is None:
        return got is want
    if isinstance(want, int):
        return type(got) is int and got == want
    if isinstance(want, float):
        return type(got) in (int, float) and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def _json_key(key: Any) -> Any:
    if isinstance(key, bool) or key is None:
        return json.dumps(key)
    return repr(key) if isinstance(key, (int, float)) else key


def as_json(value: Any) -> Any:
    """A returned value as JSON would carry it (tuples become lists, dict keys text), since expected values are
    JSON; other types (sets, bytes) stay and so do not match."""
    if isinstance(value, (list, tuple)):
        return [as_json(x) for x in value]
    if isinstance(value, dict):
        return {_json_key(k): as_json(v) for k, v in value.items()}
    return value


def return_matches(got: Any, want: Any) -> bool:
    """Functional comparison on the JSON view of the returned value; TACO wraps expected return values in a
    one-element list."""
    got = as_json(got)
    return _same(got, want) or (isinstance(want, list) and len(want) == 1 and _same(got, want[0]))


# ----------------------------------------------------------------------------------------------- LiveCodeBench
# LiveCodeBench's harness (lcb_runner/evaluation/testing_util.py) runs every program after a prelude of standard
# library imports (LeetCode starter code names List without importing it), compares stdout line by line after
# stripping, each line equal as text or as a list of decimals (exactly: "1.0" is "1", "0.3333" is not "0.33333"),
# and a returned value by Python's == once a returned tuple is made a list.

_LCB_STAR = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
             "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")
_LCB_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                "statistics", "itertools", "functools", "operator", "io", "sys", "json")
LCB_PRELUDE = ("".join(f"from {m} import *\n" for m in _LCB_STAR) + "".join(f"import {m}\n" for m in _LCB_MODULES)
               + "sys.setrecursionlimit(50000)\n")


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except InvalidOperation:
        return None


def lcb_stdout_matches(got: str, want: str) -> bool:
    """LiveCodeBench's comparison: as many lines, each equal after stripping or equal as decimals."""
    got_lines, want_lines = ([line.strip() for line in s.strip().split("\n")] for s in (got, want))
    return len(got_lines) == len(want_lines) and all(
        a == b or ((d := _decimals(a)) is not None and d == _decimals(b)) for a, b in zip(got_lines, want_lines))


def lcb_return_matches(got: Any, want: Any) -> bool:
    """LiveCodeBench's comparison of a returned value: Python's ==, a returned tuple read as a list."""
    return bool((list(got) if isinstance(got, tuple) else got) == want)


@dataclass(frozen=True)
class Convention:
    """How a benchmark's own harness runs and judges stdin/stdout and functional tests."""

    prelude: str
    stdout: Callable[[str, str], bool]
    returned: Callable[[Any, Any], bool]


JUDGE = Convention("", stdout_matches, return_matches)  # APPS, TACO, CodeContests, LeetCode: judge-style
LIVECODEBENCH = Convention(LCB_PRELUDE, lcb_stdout_matches, lcb_return_matches)


# ----------------------------------------------------------------------------------------------- running


def _limits(extra_info: dict) -> Limits:
    cpu = float(extra_info.get("time_limit_s", 4.0))
    return Limits(cpu_s=cpu, wall_s=2 * cpu + 1, memory_mb=int(extra_info.get("memory_mb", 1024)))


def _run_humaneval(program: str, spec: dict, limits: Limits) -> float:
    entry = spec["entry_point"]
    if not re.search(rf"def\s+{re.escape(entry)}\s*\(", program):
        program = spec.get("prompt", "") + program
    calls = split_check(spec["test"], entry)
    if calls is not None:
        return float(run_split(program, entry, calls, limits))
    return float(run_checker(program, spec, limits))


def _run_one(program: str, fn_name: str | None, test_input: Any, expected: Any, limits: Limits,
             convention: Convention) -> bool:
    if not fn_name:
        result = run_python(convention.prelude + program, test_input, limits).raise_for_sandbox()
        return result.ok and convention.stdout(result.stdout, expected)
    result = run_python(call_server(fn_name, True), wire.dumps(list(test_input)) + "\n", limits,
                        files={"solution.py": convention.prelude + program}).raise_for_sandbox()
    replies = parse_replies(result, 1)
    return result.ok and len(replies) == 1 and replies[0][0] == "r" and convention.returned(replies[0][1], expected)


def _run_tests(program: str, spec: dict, limits: Limits, partial: bool, convention: Convention) -> float:
    """Fraction of tests passed (all-or-nothing mode stops at the first failure and returns 0)."""
    if "test" in spec:
        return _run_humaneval(program, spec, limits)
    passed = 0
    for test_input, expected in zip(spec["inputs"], spec["outputs"]):
        ok = _run_one(program, spec.get("fn_name"), test_input, expected, limits, convention)
        passed += ok
        if not ok and not partial:
            return 0.0
    return passed / len(spec["inputs"])


def _score(response: str, ground_truth: Any, extra_info: dict, convention: Convention) -> float:
    extra_info = extra_info or {}
    program = extract_code(response)
    if program is None:
        return 0.0
    spec = parse_tests(ground_truth)
    return _run_tests(program, spec, _limits(extra_info), bool(extra_info.get("partial_credit", False)), convention)


@register("code", "codecontests", "deepmind/code_contests", "apps", "codeparrot/apps", "taco", "BAAI/TACO",
          "humaneval", "openai_humaneval", "openai/openai_humaneval", "mbpp", "google-research-datasets/mbpp",
          "leetcode")
def score_code(response: str, ground_truth: Any, extra_info: dict) -> float:
    """Run the response's program on the tests; 1.0 when all pass (or the fraction passed with partial credit)."""
    return _score(response, ground_truth, extra_info, JUDGE)


@register("livecodebench", "livecodebench/code_generation_lite")
def score_livecodebench(response: str, ground_truth: Any, extra_info: dict) -> float:
    """As ``score_code``, run and judged as LiveCodeBench's harness does (its prelude, exact decimals, ==)."""
    return _score(response, ground_truth, extra_info, LIVECODEBENCH)


# verifiers.check_ready probes the sandbox at start-up for rows scored here
score_code.needs_sandbox = score_livecodebench.needs_sandbox = True


def score_many(responses: Sequence[str], ground_truths: Sequence[Any], extra_infos: Sequence[dict],
               workers: int | None = None) -> list[float]:
    """Score many responses at once on a pool of ``workers`` (default: one per core); results in input order. Like
    ``verifiers.score``, a failure of the verifier is a 0, counted, never raised."""
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        return list(pool.map(partial(guarded, score_code), responses, ground_truths, extra_infos))
