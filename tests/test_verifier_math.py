"""Math answer extraction, equivalence, and the hard wall-clock limit of the killable check workers."""

import subprocess
import sys
import threading
import time

import pytest

from megaopd.data.answers import boxed_answer
from megaopd.data.rows import Row
from megaopd.verifiers import get_verifier
from megaopd.verifiers.extract import candidates
from megaopd.verifiers.killable import CallTimeout, KillablePool, WorkerFailed
from megaopd.verifiers.math import extract_answer, is_equivalent, score_gsm8k, score_math


@pytest.mark.parametrize("text, answer, extraction", [
    (r"so the area is \boxed{\frac{1}{2}}.", "1/2", "flexible"),  # a fraction of whole numbers is a number
    (r"\boxed{\left\{ x \mid x^{2} > 1 \right\}}", r"\left\{ x \mid x^{2} > 1 \right\}", "flexible"),
    (r"first \boxed{1}, corrected: \boxed{2}", "1,2", "flexible"),  # boxes this close are one answer, a set
    (r"first \boxed{1}. Rechecking every step of the work above it is \boxed{2}", "2", "flexible"),
    (r"\fbox{7}", "7", "flexible"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", "strict"),
    ("We get 3 and then 4.\nThe final answer is $12$.", "12", "strict"),
    ("Answer: 17", "17", "strict"),
    ("3 apples plus 4 apples is 7 apples", "7", "flexible"),
    ("3 apples plus 4 apples is 7 apples", None, "strict"),
    (r"so $x = \frac{10}{9}$", r"x = \frac{10}{9}", "flexible"),
    ("I have no idea", None, "flexible"),
])
def test_extract_answer(text, answer, extraction):
    assert extract_answer(text, extraction) == answer


def test_truncated_box_is_not_an_answer():
    assert boxed_answer(r"\boxed{\frac{1}{2}") is None
    assert extract_answer(r"so \boxed{\frac{1}{2", "strict") is None


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
    ("11 7/6", "77/6"),
])
def test_not_equivalent(pred, gold):
    assert not is_equivalent(pred, gold)


def test_score_uses_list_of_acceptable_answers():
    assert score_math(r"\boxed{4}", ["2", "4"], {}) == 1.0
    assert score_math(r"\boxed{3}", ["2", "4"], {}) == 0.0
    assert score_math("no answer here", "4", {}) == 0.0


def test_registered_for_sources_and_ability():
    for source, verifier in (("openai/gsm8k", score_gsm8k), ("gsm8k", score_gsm8k),
                             ("HuggingFaceH4/MATH-500", score_math), ("math_dapo", score_math), ("aime", score_math),
                             ("unknown-source", score_math)):
        row = Row(source, [{"role": "user", "content": "q"}], "72", ability="math")
        assert get_verifier(row) is verifier


@pytest.mark.parametrize("extra_info, problem", [
    ({"extraction": "loose"}, "extraction"),
    ({"precision": 2.5}, "precision"),
    ({"precision": 99}, "precision"),
])
def test_a_bad_option_names_itself(extra_info, problem):
    with pytest.raises(ValueError, match=rf"extra_info\['{problem}'\]"):
        score_math(r"\boxed{1}", "1", extra_info)


def burn_cores(n: int) -> list[subprocess.Popen]:
    """CPU-heavy processes loading ``n`` cores, as the rest of a trainer (or CI) does."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


# Right answers whose check runs for minutes (sympy expands both sides, degree 2000, to see that they are equal:
# over 400 s here; at degree 400 it takes 5 s and pays): only the kill can make them score 0.
SLOW_RIGHT_ANSWERS = [(r"\boxed{(x+1)^{2000}}", "(x^2+2x+1)^{1000}"), (r"\boxed{(x-1)^{2000}}", "(x^2-2x+1)^{1000}")]


@pytest.mark.parametrize("where", ["main", "worker"])
def test_a_check_past_its_limit_is_killed_and_scores_zero_under_load(where):
    """The hard limit holds from any thread while both cores are busy; the pool then answers normal checks."""
    burners = burn_cores(2)
    outcome = {"scores": [], "times": []}

    def check():
        for response, gold in SLOW_RIGHT_ANSWERS:
            is_equivalent("x^2+1", "1+x^2")  # a started worker: its start-up is no part of a check's limit
            start = time.monotonic()
            outcome["scores"].append(score_math(response, gold, {"timeout_s": 1.0}))
            outcome["times"].append(time.monotonic() - start)

    try:
        if where == "main":
            check()
        else:
            thread = threading.Thread(target=check)
            thread.start()
            thread.join(timeout=120)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert outcome["scores"] == [0.0] * len(SLOW_RIGHT_ANSWERS)
    assert max(outcome["times"]) < 1.0 + 4  # the limit, then the kill on a loaded machine
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
        with pytest.raises(WorkerFailed, match="could not start: ModuleNotFoundError: No module named 'no_such'"):
            KillablePool("no_such:f", size=1).call([], timeout_s=30)
    finally:
        pool.close()
        dies.close()


def test_a_worker_imports_the_callers_package_whatever_the_working_directory(tmp_path, monkeypatch):
    """A trainer started from another checkout's directory (here a stand-in megaopd) grades with its own code."""
    (tmp_path / "megaopd").mkdir()
    (tmp_path / "megaopd" / "__init__.py").write_text("raise ImportError('the other checkout')\n")
    monkeypatch.chdir(tmp_path)
    pool = KillablePool("megaopd.verifiers.math_grade:grade", size=1)
    try:
        assert pool.call([[[["latex", "x+1", False]]], [[["latex", "1+x", False]]], 6], timeout_s=60) is True
    finally:
        pool.close()


def test_an_answer_that_would_build_a_huge_number_does_not_hang_the_caller():
    """The cheap exact-number path runs in the caller's process, so it must not expand 1e999999999 (a subprocess
    keeps this test bounded even where that hangs)."""
    code = "from megaopd.verifiers.math import score_math; print(score_math(r'\\boxed{1e999999999}', '1', {}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "0.0", done.stderr[-2000:]


# Responses that make a backtracking or rescanning extractor quadratic: the reference's regexes take tens of
# seconds on 30,000 characters of "1 " or "\(", and our first ones minutes on blank lines after "the answer".
HOSTILE_UNITS = ["\n", " \n", "1 ", "=1", "\\(", "\\[", "$", " [", "answer: ", "final answer is ", "\\boxed{", "#### \n",
                 "$1$ and "]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("unit", HOSTILE_UNITS)
def test_extraction_time_is_linear_in_the_response(unit):
    """Eight times the text takes about eight times as long (under 20), not 64: extraction runs in the trainer's
    process, on model output."""
    texts = [unit * (chars // len(unit)) for chars in (6_000, 48_000)]
    best = [float("inf")] * 2
    # This process's CPU time, not the wall clock: on a loaded machine a nice'd test waits for the cores, and the
    # longer text waits more often (a wall-clock run beside a study read 0.18 s against 0.002 s). Interleaved, each
    # the best of three.
    for _ in range(3):
        for i, text in enumerate(texts):
            start = time.process_time()
            candidates(text)
            best[i] = min(best[i], time.process_time() - start)
    small, large = best
    assert large < 20 * small + 0.05, (small, large)
