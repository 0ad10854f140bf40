import json

import pytest

from megaopd.data.rows import RowError, load_rows, write_rows
from megaopd.data.synthetic import DOMAINS, corrupt, make_split, make_splits
from megaopd.models.embedded import build_data
from megaopd.verifiers import get_verifier, score


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_train_validation_and_test_files_do_not_overlap_and_are_fixed_by_the_seed(tmp_path, domain):
    """Three files per domain; validation and test are distinct problems, disjoint from each other and from train;
    the same seed writes the same files, another seed other problems; the test rows are the held-out stream's first
    (what the single held-out file held before the validation split)."""
    def keys(out, split):
        rows, _ = load_rows(out / domain / f"{split}.jsonl", strict=True)
        return [r.extra_info["key"] for r in rows]

    for seed, out in ((0, tmp_path / "a"), (0, tmp_path / "b"), (1, tmp_path / "c")):
        build_data(out, [domain], train_rows=600, heldout_rows=60, validation_rows=40, seed=seed)
    train, validation, test = (set(keys(tmp_path / "a", split)) for split in ("train", "validation", "test"))
    assert len(keys(tmp_path / "a", "test")) == len(test) == 60 and len(validation) == 40  # distinct problems
    assert not train & validation and not train & test and not validation & test
    assert {r.data_source for r in load_rows(tmp_path / "a" / domain / "train.jsonl")[0]} == {domain}
    for split in ("train", "validation", "test"):
        assert (tmp_path / "a" / domain / f"{split}.jsonl").read_bytes() == \
            (tmp_path / "b" / domain / f"{split}.jsonl").read_bytes()
        assert keys(tmp_path / "a", split) != keys(tmp_path / "c", split)
    assert keys(tmp_path / "a", "test") == [r.extra_info["key"] for r in make_split(domain, "test", 60)]
    with pytest.raises(ValueError, match="give the test count too"):
        make_splits(domain, {"validation": 5})


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_difficulty_knob_changes_the_problems(domain):
    easy = make_split(domain, "train", 20, difficulty=DOMAINS[domain].default_difficulty)
    hard = make_split(domain, "train", 20, difficulty=DOMAINS[domain].default_difficulty + 1)
    assert sum(len(r.extra_info["solution"]) for r in hard) > sum(len(r.extra_info["solution"]) for r in easy)


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_verifier_scores_worked_solutions_and_rejects_wrong_ones(domain):
    rows = make_split(domain, "test", 30)
    for row in rows:
        solution = row.extra_info["solution"]
        assert score(row, solution) == 1.0
        assert score(row, solution.rsplit("answer:", 1)[0] + "answer:" + str(int(row.ground_truth) + 1)) == 0.0
        assert score(row, solution + "7") == 0.0  # a longer number is a different answer
        assert score(row, solution.replace("answer:", "")) == 0.0  # no answer line, no credit
    assert get_verifier(rows[0]) is get_verifier(make_split(domain, "train", 1)[0])


def test_worked_solutions_are_tens_of_tokens():
    for domain in DOMAINS:
        lengths = [len(r.extra_info["solution"]) for r in make_split(domain, "train", 50)]
        assert 15 <= sum(lengths) / len(lengths) <= 60, domain


def test_corruption_changes_the_solution():
    import random

    rng = random.Random(0)
    solution = make_split("arith_add", "train", 1)[0].extra_info["solution"]
    assert sum(corrupt(solution, rng) != solution for _ in range(50)) >= 40


def test_malformed_rows_name_file_and_line_and_are_counted(tmp_path):
    good = make_split("arith_add", "train", 2)
    path = tmp_path / "mixed.jsonl"
    write_rows(path, good)
    with path.open("a") as f:
        f.write("{not json\n")
        f.write(json.dumps({"data_source": "arith_add", "prompt": "hi"}) + "\n")
        f.write(json.dumps({"data_source": "arith_add", "prompt": [], "reward_model": {"ground_truth": 1}}) + "\n")
    rows, report = load_rows(path)
    assert len(rows) == 2 and report.loaded == 2 and len(report.skipped) == 3
    assert [e.lineno for e in report.skipped] == [3, 4, 5]
    assert "invalid JSON" in report.skipped[0].problem
    assert "reward_model" in report.skipped[1].problem
    assert f"{path}:4" in report.summary()
    with pytest.raises(RowError, match=r"mixed\.jsonl:3: invalid JSON"):
        load_rows(path, strict=True)


def _record(**changes) -> dict:
    """A good record with `changes` set (dotted keys reach into reward_model and the first message)."""
    record = make_split("arith_add", "train", 1)[0].to_dict()
    for key, value in changes.items():
        where, _, name = key.rpartition(".")
        {"": record, "reward_model": record["reward_model"], "message": record["prompt"][0]}[where][name] = value
    return record


# null: what a Parquet column holds where a record lacks the value (a column holds one type)
WRONG_TYPES = {"data_source": None, "message.content": None, "reward_model.ground_truth": None}


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_records_of_the_wrong_types_are_skipped_with_file_and_line(tmp_path, suffix):
    """A field of the wrong type is a malformed record (skipped, named), not a prompt reading "None" or a verifier
    that fails at the first step; in JSONL a line that is not UTF-8 is one too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [_record()] + [_record(**{key: value}) for key, value in WRONG_TYPES.items()]
    path = tmp_path / f"typed.{suffix}"
    if suffix == "jsonl":
        path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + b'{"data_source": "\xff"}\n')
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    rows, report = load_rows(path)
    assert len(rows) == 1
    assert [e.lineno for e in report.skipped] == list(range(2, len(records) + 1 + (suffix == "jsonl")))
    assert "'data_source' must be a non-empty string" in report.skipped[0].problem
    assert "messages with string values" in report.skipped[1].problem
    assert "ground_truth' that is not null" in report.skipped[2].problem
    if suffix == "jsonl":
        assert report.skipped[-1].problem == "not UTF-8 text (byte 0xff at column 18)"
    with pytest.raises(RowError) as err:
        load_rows(path, strict=True)
    assert err.value.line() == (f"megaopd: data error: {path}:2: field 'data_source' must be a non-empty string (it "
                                "picks the verifier); fix or remove that record (data.strict=false skips malformed "
                                "records)")


@pytest.mark.parametrize("fault", ["json_cut_short", "parquet_cut_short", "not_parquet", "every_record_bad",
                                   "unknown_suffix"])
def test_a_data_file_that_cannot_be_read_is_one_data_error(tmp_path, fault):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megaopd.errors import DataError

    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([_record()] * 20), good)
    path, expected = {
        "json_cut_short": (tmp_path / "d.json", r"d\.json:1: invalid JSON \(Expecting value at column 16\); fix"),
        "parquet_cut_short": (tmp_path / "d.parquet", r"d\.parquet is not a readable Parquet file \(.+\); give a"),
        "not_parquet": (tmp_path / "e.parquet", r"e\.parquet is not a readable Parquet file \(.+\); give a"),
        "every_record_bad": (tmp_path / "d.jsonl", r"no record of .+d\.jsonl can be used \(2 malformed; the first: "
                                                   r".+d\.jsonl:1: invalid JSON .+\); fix the file"),
        "unknown_suffix": (tmp_path / "d.csv", r"d\.csv: unsupported dataset format '\.csv'; use"),
    }[fault]
    path.write_bytes({"json_cut_short": b'[{"prompt": 1},', "parquet_cut_short": good.read_bytes()[:300],
                      "not_parquet": b"PAR1 and no more", "every_record_bad": b"a,b\n1,2\n",
                      "unknown_suffix": b"a,b\n"}[fault])
    with pytest.raises(DataError, match=expected):
        load_rows(path)


def test_parquet_rows_load_through_the_same_path(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = make_split("prog_trace", "train", 3)
    pq.write_table(pa.Table.from_pylist([r.to_dict() for r in rows]), tmp_path / "d.parquet")
    loaded, report = load_rows(tmp_path / "d.parquet", strict=True)
    assert [r.prompt for r in loaded] == [r.prompt for r in rows] and report.loaded == 3


def test_worded_solutions_keep_the_problems_and_grow_the_length():
    rows = {v: make_split("arith_add", "test", 100, verbosity=v, heldout_percent=20) for v in range(3)}
    for v in (1, 2):
        assert [r.prompt for r in rows[v]] == [r.prompt for r in rows[0]]
        assert [r.ground_truth for r in rows[v]] == [r.ground_truth for r in rows[0]]
    mean = {v: sum(len(r.extra_info["solution"]) for r in rs) / len(rs) for v, rs in rows.items()}
    assert 15 < mean[0] < 30 and 50 < mean[1] < 80 and 120 < mean[2] < 180  # byte tokens: ~20, ~60, ~150
    for r in rows[2]:
        assert score(r, r.extra_info["solution"]) == 1.0
    with pytest.raises(ValueError, match="verbosity"):
        make_split("prog_trace", "train", 3, verbosity=1)
