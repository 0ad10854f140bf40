"""Code verifier: run the program in a response against a row's tests, inside the sandbox.

The program is the last fenced code block of the response (```python ... ```), or the whole response when it has no
fence but looks like code. ``ground_truth`` is one of these layouts (or a JSON string of one):

* stdin/stdout (APPS, TACO, CodeContests, LiveCodeBench "stdin")::

      {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}

  Output matches when equal line by line after trailing whitespace, or token by token with numbers within 1e-6.
* functional (LeetCode, APPS/TACO with ``fn_name``, LiveCodeBench "functional")::

      {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], ...], "outputs": [[0, 1], ...]}

  Each entry of ``inputs`` is the list of positional arguments. The call goes to ``Solution().fn_name`` when the
  program defines ``class Solution`` (LeetCode starter code), else to the top-level function. The return value is
  compared after a JSON round trip (tuples become lists); an expected value wrapped in a one-element list, as
  TACO stores them, also matches.
* HumanEval::

      {"test": "def check(candidate): ...", "entry_point": "f", "prompt": "def f(x):\\n    \\"\\"\\"...\\"\\"\\"\\n"}

  ``prompt`` is prepended when the response only holds the function body. ``check(candidate)`` runs in the
  program's own process, so a program that sets out to introspect the harness could forge a pass; a program
  that merely exits early (``os._exit(0)``) does not pass.

``extra_info`` options: ``partial_credit`` (score the fraction of tests passed; default all-or-nothing, which stops
at the first failure), ``time_limit_s`` (CPU seconds per test, default 4; wall clock is twice that plus one) and
``memory_mb`` (default 1024). Every test is a fresh sandboxed process.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from megaopd.verifiers import register
from megaopd.verifiers.sandbox import Limits, Result, default_workers, run_python

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_CODE_HINT = re.compile(r"^\s*(def |class |import |from \w+ import |print\(|for |while |if __name__)", re.MULTILINE)


def extract_code(response: str) -> str | None:
    """The program in a response: the last Python (or unlabelled) fenced block, else the bare text if it is code."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(response)]
    python = [body for lang, body in blocks if lang in ("python", "python3", "py", "")]
    if python:
        return python[-1]
    if not blocks and _CODE_HINT.search(response):
        return response
    return None


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


# ----------------------------------------------------------------------------------------------- comparison

def _close(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


def _token_equal(a: str, b: str) -> bool:
    try:
        return a == b or math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def stdout_matches(got: str, want: str) -> bool:
    """Judge-style comparison: lines equal up to trailing whitespace, or tokens equal with float tolerance."""
    def lines(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip("\n").split("\n")]

    if lines(got) == lines(want):
        return True
    got_tokens, want_tokens = got.split(), want.split()
    return len(got_tokens) == len(want_tokens) and all(map(_token_equal, got_tokens, want_tokens))


def return_matches(got: Any, want: Any) -> bool:
    """Functional comparison after a JSON round trip; TACO wraps expected return values in a one-element list."""
    want = json.loads(json.dumps(want))
    return _close(got, want) or (isinstance(want, list) and len(want) == 1 and _close(got, want[0]))


# ----------------------------------------------------------------------------------------------- harnesses
# Each harness is main.py; the model's program is solution.py beside it, so its `if __name__ == "__main__"` block
# does not run for functional tests and its globals are not the harness's.

_CALL_HARNESS = """
import json, runpy, sys
args = json.loads(sys.stdin.readline())
ns = runpy.run_path("solution.py", run_name="solution")
fn = getattr(ns["Solution"](), {fn!r}) if "Solution" in ns else ns[{fn!r}]
result = json.loads(json.dumps(fn(*args)))
sys.stdout.write("\\n" + {marker!r} + json.dumps(result) + "\\n")
"""

_CHECK_HARNESS = """
import runpy, sys
def main():  # nonce and tests stay locals, read before the program runs: it cannot print the pass line or read
    nonce, test = sys.stdin.readline().strip(), sys.stdin.read()  # the asserts without digging through frames
    ns = runpy.run_path("solution.py", run_name="solution")
    exec(compile(test, "test.py", "exec"), ns)
    ns["check"](ns[{entry_point!r}])
    sys.stdout.write("\\n" + {marker!r} + nonce + "\\n")
main()
"""


def _limits(extra_info: dict) -> Limits:
    cpu = float(extra_info.get("time_limit_s", 4.0))
    return Limits(cpu_s=cpu, wall_s=2 * cpu + 1, memory_mb=int(extra_info.get("memory_mb", 1024)))


def _last_marked(result: Result, marker: str) -> str | None:
    lines = [line for line in result.stdout.split("\n") if line.startswith(marker)]
    return lines[-1][len(marker):] if result.ok and lines else None


def _run_tests(program: str, spec: dict, limits: Limits, partial: bool) -> float:
    """Fraction of tests passed (all-or-nothing mode stops at the first failure and returns 0)."""
    marker = f"@@megaopd-result-{secrets.token_hex(8)}@@"
    if "test" in spec:
        entry = spec["entry_point"]
        if not re.search(rf"def\s+{re.escape(entry)}\s*\(", program):
            program = spec.get("prompt", "") + program
        nonce = secrets.token_hex(16)
        harness = _CHECK_HARNESS.format(entry_point=entry, marker=marker)
        result = run_python(harness, nonce + "\n" + spec["test"], limits, files={"solution.py": program})
        return float(_last_marked(result, marker) == nonce)

    fn_name = spec.get("fn_name")
    passed = 0
    for test_input, expected in zip(spec["inputs"], spec["outputs"]):
        if fn_name:
            harness = _CALL_HARNESS.format(fn=fn_name, marker=marker)
            result = run_python(harness, json.dumps(test_input) + "\n", limits, files={"solution.py": program})
            raw = _last_marked(result, marker)
            ok = raw is not None and return_matches(json.loads(raw), expected)
        else:
            result = run_python(program, test_input, limits)
            ok = result.ok and stdout_matches(result.stdout, expected)
        passed += ok
        if not ok and not partial:
            return 0.0
    return passed / len(spec["inputs"])


@register("code", "codecontests", "deepmind/code_contests", "apps", "codeparrot/apps", "taco", "BAAI/TACO",
          "livecodebench", "livecodebench/code_generation_lite", "humaneval", "openai_humaneval",
          "openai/openai_humaneval", "leetcode")
def score_code(response: str, ground_truth: Any, extra_info: dict) -> float:
    """Run the response's program on the tests; 1.0 when all pass (or the fraction passed with partial credit)."""
    extra_info = extra_info or {}
    program = extract_code(response)
    if program is None:
        return 0.0
    spec = parse_tests(ground_truth)
    return _run_tests(program, spec, _limits(extra_info), bool(extra_info.get("partial_credit", False)))


def score_many(responses: Sequence[str], ground_truths: Sequence[Any], extra_infos: Sequence[dict],
               workers: int | None = None) -> list[float]:
    """Score many responses at once on a pool of ``workers`` (default: one per core); results in input order."""
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        return list(pool.map(score_code, responses, ground_truths, extra_infos))
