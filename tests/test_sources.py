"""Source converters: each layout becomes rows its verifier scores; bad records name file and line."""

import base64
import json
import pickle
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megaopd.data.rows import RowError
from megaopd.data.sources import convert
from megaopd.verifiers import score


def write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_gsm8k_with_malformed_rows(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "Natalia sold 48 clips, then half as many. How many?", "answer": "48/2 = 24\n#### 1,072"},
        {"question": "no final line", "answer": "it is 3"},
        "{not json",
        {"answer": "#### 4"},
        [1, 2],
    ])
    rows, report = convert(path, "gsm8k")
    assert [r.ground_truth for r in rows] == ["1072"] and report.loaded == 1
    assert [(e.lineno, e.path) for e in report.skipped] == [(2, str(path)), (3, str(path)), (4, str(path)),
                                                          (5, str(path))]
    problems = [e.problem for e in report.skipped]
    assert "####" in problems[0] and "invalid JSON" in problems[1] and "'question'" in problems[2]
    assert "expected a JSON object" in problems[3]
    assert f"{path}:2:" in report.summary()
    assert score(rows[0], "so \\boxed{1072}") == 1.0 and score(rows[0], "#### 1071") == 0.0
    assert rows[0].extra_info["domain"] == "math" and "\\boxed{}" in rows[0].prompt[0]["content"]


def test_strict_mode_raises_at_the_first_bad_row(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "q", "answer": "#### 1"}, {"question": "q"}])
    with pytest.raises(RowError) as err:
        convert(path, "gsm8k", strict=True)
    assert err.value.lineno == 2 and err.value.path == str(path)


def test_unknown_source_names_the_known_ones(tmp_path):
    with pytest.raises(KeyError, match="gsm8k"):
        convert(tmp_path / "x.jsonl", "gsm8")


def test_math_layouts_from_parquet_and_json(tmp_path):
    pq.write_table(pa.Table.from_pylist([
        {"problem": "Compute 1/2 + 1/4.", "solution": "We get $\\boxed{\\frac{3}{4}}$.", "level": "Level 1"},
        {"problem": "No answer", "solution": "I give up.", "level": "Level 5"},
    ]), tmp_path / "math.parquet")
    rows, report = convert(tmp_path / "math.parquet", "math")
    assert [r.ground_truth for r in rows] == ["\\frac{3}{4}"] and report.skipped[0].lineno == 2
    assert score(rows[0], "\\boxed{0.75}") == 1.0

    (tmp_path / "aime.json").write_text(json.dumps([{"ID": "2024-I-1", "Problem": "p", "Answer": 204},
                                                    {"ID": "2024-I-2", "Problem": "p"}]))
    rows, report = convert(tmp_path / "aime.json", "aime")
    assert rows[0].ground_truth == "204" and rows[0].extra_info["id"] == "2024-I-1" and len(report.skipped) == 1

    rows, _ = convert(write_jsonl(tmp_path / "m5.jsonl", [{"problem": "p", "solution": "s", "answer": "5"}]), "math500")
    rows += convert(write_jsonl(tmp_path / "ds.jsonl", [{"problem": "p", "answer": "\\sqrt{2}"}]), "deepscaler")[0]
    assert [r.data_source for r in rows] == ["HuggingFaceH4/MATH-500", "agentica-org/DeepScaleR-Preview-Dataset"]


def test_dapo_rows_are_already_in_the_row_format(tmp_path):
    good = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "q"}], "ability": "MATH",
            "reward_model": {"style": "rule", "ground_truth": "34"}, "extra_info": {"index": "a"}}
    path = write_jsonl(tmp_path / "dapo.jsonl", [good, {"data_source": "math_dapo", "prompt": "q"}])
    rows, report = convert(path, "dapo")
    assert rows[0].ground_truth == "34" and score(rows[0], "\\boxed{34}") == 1.0
    assert report.skipped[0].path == str(path) and "reward_model" in report.skipped[0].problem


def test_apps_taco_codecontests_livecodebench(tmp_path):
    add = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    write_jsonl(tmp_path / "apps.jsonl", [
        {"problem_id": 1, "question": "Add.", "input_output": json.dumps(add), "starter_code": ""},
        {"problem_id": 2, "question": "Broken", "input_output": "{not json"},
        {"problem_id": 3, "question": "Fn", "starter_code": "class Solution:\n    def f(self, x):",
         "input_output": json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [[2]]})},
    ])
    assert convert(tmp_path / "apps.jsonl", "apps")[0][0].data_source == "apps"
    rows, report = convert(tmp_path / "apps.jsonl", "taco")
    assert len(rows) == 2 and "not valid JSON" in report.skipped[0].problem and report.skipped[0].lineno == 2
    assert score(rows[0], "```python\nprint(sum(map(int, input().split())))\n```") == 1.0
    assert "class Solution" in rows[1].prompt[0]["content"]
    assert score(rows[1], "```python\nclass Solution:\n    def f(self, x):\n        return 2 * x\n```") == 1.0

    write_jsonl(tmp_path / "cc.jsonl", [
        {"name": "a", "description": "Add.", "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
         "private_tests": {"input": ["5 5\n"], "output": ["10\n"]}, "generated_tests": {"input": [], "output": []}},
        {"name": "b", "description": "No tests", "public_tests": {"input": [], "output": []}},
    ])
    rows, report = convert(tmp_path / "cc.jsonl", "codecontests")
    assert rows[0].ground_truth["inputs"] == ["1 2\n", "5 5\n"] and "empty" in report.skipped[0].problem

    private = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(
        [{"input": "[1, 2]\n3", "output": "[4, 5]", "testtype": "functional"}])))).decode()
    evil = base64.b64encode(zlib.compress(pickle.dumps(print))).decode()  # a pickle that names a global
    write_jsonl(tmp_path / "lcb.jsonl", [
        {"question_id": "q1", "question_content": "Add k to each.",
         "starter_code": "class Solution:\n    def addK(self, nums, k):",
         "public_test_cases": json.dumps([{"input": "[1]\n2", "output": "[3]", "testtype": "functional"}]),
         "private_test_cases": private, "metadata": json.dumps({"func_name": "addK"})},
        {"question_id": "q2", "question_content": "x", "public_test_cases": "[]", "private_test_cases": evil},
    ])
    rows, report = convert(tmp_path / "lcb.jsonl", "livecodebench")
    assert rows[0].ground_truth == {"fn_name": "addK", "inputs": [[[1], 2], [[1, 2], 3]], "outputs": [[3], [4, 5]]}
    assert "refusing to load" in report.skipped[0].problem
    solution = "```python\nclass Solution:\n    def addK(self, nums, k):\n        return [x + k for x in nums]\n```"
    assert score(rows[0], solution) == 1.0


def test_humaneval_file_layout(tmp_path):
    record = {"task_id": "HumanEval/0", "prompt": "def inc(x):\n", "canonical_solution": "    return x + 1\n",
              "test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "inc"}
    rows, report = convert(write_jsonl(tmp_path / "he.jsonl", [record, {"task_id": "HumanEval/1"}]), "humaneval")
    assert score(rows[0], "```python\n    return x + 1\n```") == 1.0
    assert score(rows[0], "```python\n    return x\n```") == 0.0
    assert "'prompt'" in report.skipped[0].problem


def test_science_layouts(tmp_path):
    write_jsonl(tmp_path / "gpqa.jsonl", [
        {"Record ID": "r1", "Question": "Which is a noble gas?", "Correct Answer": "Neon",
         "Incorrect Answer 1": "Iron", "Incorrect Answer 2": "Sodium", "Incorrect Answer 3": "Carbon"},
        {"Question": "Missing distractors", "Correct Answer": "x"},
    ])
    rows, report = convert(tmp_path / "gpqa.jsonl", "gpqa")
    again, _ = convert(tmp_path / "gpqa.jsonl", "gpqa")
    letter = rows[0].ground_truth
    assert letter == again[0].ground_truth  # deterministic shuffle
    assert f"({letter}) Neon" in rows[0].prompt[0]["content"] and "Incorrect Answer 1" in report.skipped[0].problem
    assert score(rows[0], f"\\boxed{{{letter}}}") == 1.0
    assert score(rows[0], "\\boxed{" + ("A" if letter != "A" else "B") + "}") == 0.0

    sciq = {"question": "What gas do plants absorb?", "correct_answer": "carbon dioxide", "distractor1": "oxygen",
            "distractor2": "helium", "distractor3": "neon", "support": ""}
    rows, _ = convert(write_jsonl(tmp_path / "sciq.jsonl", [sciq]), "sciq")
    assert f"({rows[0].ground_truth}) carbon dioxide" in rows[0].prompt[0]["content"]

    write_jsonl(tmp_path / "mmlu.jsonl", [
        {"question": "2+2?", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1},
        {"question": "MMLU-Pro", "options": list("abcdefghij"), "answer": "J", "answer_index": 9},
        {"question": "out of range", "choices": ["3", "4"], "answer": 3},
        {"question": "bad answer", "choices": ["3", "4"], "answer": "four"},
    ])
    rows, report = convert(tmp_path / "mmlu.jsonl", "mmlu")
    assert [(r.data_source, r.ground_truth, r.extra_info["num_choices"]) for r in rows] == [
        ("mmlu", "B", 4), ("mmlu_pro", "J", 10)]
    assert [e.lineno for e in report.skipped] == [3, 4]


def test_ifeval_layout(tmp_path):
    write_jsonl(tmp_path / "ifeval.jsonl", [
        {"key": 1, "prompt": "Write without commas, in lowercase.",
         "instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"], "kwargs": [{}, {}]},
        {"key": 2, "prompt": "Reply in French.", "instruction_id_list": ["language:response_language"],
         "kwargs": [{"language": "fr"}]},
        {"key": 3, "prompt": "x", "instruction_id_list": ["keywords:existence"], "kwargs": [{"words": ["a"]}]},
    ])
    rows, report = convert(tmp_path / "ifeval.jsonl", "ifeval")
    assert len(rows) == 1 and rows[0].ability == "instruction_following"
    assert score(rows[0], "all good here") == 1.0 and score(rows[0], "Not, good") == 0.0
    assert "unsupported" in report.skipped[0].problem and "bad kwargs" in report.skipped[1].problem

