"""Math answer extraction, equivalence and the per-check deadline."""

import threading
import time

import pytest

from megaopd.data.rows import Row
from megaopd.verifiers import get_verifier
from megaopd.verifiers.math import (CheckTimeout, _Deadline, extract_answer, is_equivalent, last_boxed, normalize,
                                    score_math)


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


@pytest.mark.parametrize("where", ["main", "worker"])
def test_deadline_interrupts_a_busy_check_on_any_thread(where):
    outcome = {}

    def busy():
        start = time.monotonic()
        try:
            with _Deadline(0.2):
                while time.monotonic() - start < 10:
                    pass
            outcome["result"] = "finished"
        except CheckTimeout:
            outcome["result"] = time.monotonic() - start

    if where == "main":
        busy()
    else:
        thread = threading.Thread(target=busy)
        thread.start()
        thread.join()
    assert isinstance(outcome["result"], float) and outcome["result"] < 2


def test_deadline_does_not_fire_after_the_block():
    with _Deadline(0.05):
        pass
    time.sleep(0.15)  # an exception leaking out of the block would be raised here


def test_slow_check_scores_zero_within_timeout(monkeypatch):
    import megaopd.verifiers.math as m

    def slow(pred, gold):
        while True:
            pass

    monkeypatch.setattr(m, "_math_verify_equal", slow)
    start = time.monotonic()
    assert m.score_math(r"\boxed{x+y}", "y+x+1", {"timeout_s": 0.3}) == 0.0
    assert time.monotonic() - start < 3
