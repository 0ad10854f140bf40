"""Math answer extraction, equivalence, and the hard wall-clock limit of the killable check workers."""

import subprocess
import sys
import threading
import time

import pytest

from megaopd.data.answers import last_boxed
from megaopd.data.rows import Row
from megaopd.verifiers import get_verifier
from megaopd.verifiers.killable import CallTimeout, KillablePool, WorkerFailed
from megaopd.verifiers.math import extract_answer, is_equivalent, normalize, score_math


@pytest.mark.parametrize("text, answer", [
    (r"so the area is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{\left\{ x \mid x^{2} > 1 \right\}}", r"\left\{ x \mid x^{2} > 1 \right\}"),
    (r"first \boxed{1}, corrected: \boxed{2}", "2"),
    (r"\fbox{7}", "7"),
    (r"\boxed 5 is it", "5"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("We get 3 and then 4.\nThe final answer is $12$.", "12"),
    ("Answer: 17", "17"),
    ("3 apples plus 4 apples is 7 apples", "7"),
    ("I have no idea", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_truncated_box_is_not_an_answer():
    assert last_boxed(r"\boxed{\frac{1}{2") is None


@pytest.mark.parametrize("pred, gold", [
    ("0.5", r"\frac{1}{2}"),
    (r"\dfrac{3}{4}", "0.75"),
    ("1,000,000", "1000000"),
    (r"50\%", "0.5"),
    ("50%", "50"),
    (r"10\text{ cm}", "10"),
    ("10 cm", "10"),
    (r"90^\circ", "90"),
    (r"\$5.00", "5"),
    ("x = 3", "3"),
    ("x^2+1", "1+x^2"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),
    ("sqrt(2)/2", "1/sqrt(2)"),
    (r"\{1,2\}", r"\{2,1\}"),
    (r"(1, 2)", "(1,2)"),
])
def test_equivalent(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("7", "8"),
    ("0.33", "1/3"),
    ("(1,2)", "(2,1)"),
    ("x^2", "x^3"),
    ("", "0"),
    ("-5", "5"),
    ("51%", "0.5"),
])
def test_not_equivalent(pred, gold):
    assert not is_equivalent(pred, gold)


def test_normalize_strips_latex_noise():
    assert normalize(r"$\left( 3, \! 4 \right)$") == "(3,4)"


def test_score_uses_list_of_acceptable_answers():
    assert score_math(r"\boxed{4}", ["2", "4"], {}) == 1.0
    assert score_math(r"\boxed{3}", ["2", "4"], {}) == 0.0
    assert score_math("no answer here", "4", {}) == 0.0


def test_registered_for_sources_and_ability():
    for source in ("openai/gsm8k", "HuggingFaceH4/MATH-500", "math_dapo", "aime", "unknown-source"):
        row = Row(source, [{"role": "user", "content": "q"}], "72", ability="math")
        assert get_verifier(row) is score_math


def burn_cores(n: int) -> list[subprocess.Popen]:
    """CPU-heavy processes loading ``n`` cores, as the rest of a trainer (or CI) does."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.parametrize("where", ["main", "worker"])
def test_pathological_answers_score_zero_within_the_limit_under_load(where):
    """The hard limit holds from any thread while both cores are busy; the pool then answers normal checks."""
    assert is_equivalent("x^2+1", "1+x^2")  # starts a worker outside the timing
    burners = burn_cores(2)
    outcome = {}

    def check():
        outcome["times"] = []
        for answer in ("9**9**9", "(x+1)^{100000}", r"\sin(x)^{2000}+\cos(x)^{2000}"):
            start = time.monotonic()
            outcome.setdefault("scores", []).append(score_math(rf"\boxed{{{answer}}}", "y+1", {"timeout_s": 1.0}))
            outcome["times"].append(time.monotonic() - start)

    try:
        if where == "main":
            check()
        else:
            thread = threading.Thread(target=check)
            thread.start()
            thread.join(timeout=60)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert outcome["scores"] == [0.0] * 3
    assert max(outcome["times"]) < 1.0 + 10  # the kill itself; slack for a fresh worker's start on a loaded box
    assert is_equivalent(r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}")


def test_a_check_stuck_in_one_c_call_is_killed():
    """What a timer thread or a signal handler inside the process cannot interrupt: one long C call."""
    pool = KillablePool("time:sleep", size=1, memory_mb=512)
    try:
        pool.call([0], timeout_s=30)
        start = time.monotonic()
        with pytest.raises(CallTimeout):
            pool.call([600], timeout_s=0.5)
        assert time.monotonic() - start < 5
        assert pool.call([0], timeout_s=30) is None  # a fresh worker took the killed one's place
    finally:
        pool.close()


def test_a_check_that_raises_or_dies_is_an_error_not_a_hang():
    pool = KillablePool("math:sqrt", size=1, memory_mb=512)
    dies = KillablePool("os:_exit", size=1, memory_mb=512)
    try:
        with pytest.raises(WorkerFailed, match="ValueError"):
            pool.call([-1], timeout_s=30)
        assert pool.call([4], timeout_s=30) == 2.0
        with pytest.raises(WorkerFailed, match="died"):
            dies.call([3], timeout_s=30)
    finally:
        pool.close()
        dies.close()


def test_an_answer_that_would_build_a_huge_number_does_not_hang_the_caller():
    """The cheap exact-number path runs in the caller's process, so it must not expand 1e999999999 (a subprocess
    keeps this test bounded even where that hangs)."""
    code = "from megaopd.verifiers.math import score_math; print(score_math(r'\\boxed{1e999999999}', '1', {}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "0.0", done.stderr[-2000:]


def test_extraction_is_linear_in_the_response():
    """Blank lines and long whitespace after "the answer" / "####" backtracked for minutes in the caller's process
    (run in a subprocess so the test stays bounded where that happens)."""
    code = ("from megaopd.verifiers.math import extract_answer, normalize\n"
            "for text in ['\\n' * 200000, ' \\n' * 200000, 'the answer' + ' ' * 100000, '####' + '\\n' * 100000]:\n"
            "    normalize(extract_answer(text) or '')\nprint('done')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "done", done.stderr[-2000:]
