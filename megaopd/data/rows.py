"""Dataset rows in the common RL format, read from JSONL, JSON or Parquet.

A row looks like (verl / DAPO / DeepScaleR layout):

    {"data_source": "synthetic/add", "ability": "arithmetic",
     "prompt": [{"role": "user", "content": "..."}],
     "reward_model": {"style": "rule", "ground_truth": "71"},
     "extra_info": {"split": "train", "index": 3, ...}}

A malformed record never kills a run half-way: it is skipped, counted, and reported with its file, line (or
Parquet row) and what is wrong, unless the caller asked for ``strict=True``. A file that cannot be read at all (not
JSON, not Parquet), or none of whose records can be used, is refused in one line naming it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from megaopd.errors import DataError, require_file

log = logging.getLogger(__name__)


class RowError(DataError):
    """A record that cannot be used, with where it came from (its line, or Parquet row: ``lineno``)."""

    def __init__(self, path: str | Path, line: int, problem: str):
        self.path, self.lineno, self.problem = str(path), line, problem
        super().__init__(f"{path}:{line}: {problem}")

    def line(self) -> str:
        return f"{super().line()}; fix or remove that record (data.strict=false skips malformed records)"


@dataclass
class Row:
    data_source: str  # which dataset / synthetic task; picks the verifier and the multi-teacher route
    prompt: list[dict[str, str]]  # chat messages; rendered by the tokenizer's chat template
    ground_truth: Any  # reward_model.ground_truth, whatever the verifier expects
    ability: str = ""  # coarse domain (math, code, ...); fallback key for the verifier
    extra_info: dict[str, Any] = field(default_factory=dict)

    @property
    def domain(self) -> str:
        """The routing key: extra_info.domain when given, else the data_source."""
        return str(self.extra_info.get("domain", self.data_source))

    def to_dict(self) -> dict[str, Any]:
        return {
            "data_source": self.data_source,
            "prompt": self.prompt,
            "ability": self.ability,
            "reward_model": {"style": "rule", "ground_truth": self.ground_truth},
            "extra_info": self.extra_info,
        }


@dataclass
class LoadReport:
    """What a load skipped, so the caller can log and report it."""

    path: str
    loaded: int = 0
    skipped: list[RowError] = field(default_factory=list)

    def summary(self) -> str:
        text = f"{self.path}: {self.loaded} rows loaded, {len(self.skipped)} skipped"
        for err in self.skipped[:5]:
            text += f"\n  {err}"
        if len(self.skipped) > 5:
            text += f"\n  ... and {len(self.skipped) - 5} more"
        return text


def iter_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield (line or row number starting at 1, raw record) from a .jsonl, .json or .parquet file.

    A JSONL line that is not valid JSON is yielded as a RowError instance so the caller decides whether to skip.
    """
    require_file(path, "data file", DataError)
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        with path.open("rb") as f:  # bytes: a line that is not UTF-8 is one bad record, not an unreadable file
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as e:
                    yield lineno, RowError(path, lineno, f"not UTF-8 text (byte {line[e.start]:#x} at column "
                                                         f"{e.start + 1})")
                except json.JSONDecodeError as e:
                    yield lineno, RowError(path, lineno, f"invalid JSON ({e.msg} at column {e.colno})")
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno}); fix the file") from None
        except UnicodeDecodeError:
            raise DataError(f"{path} is not UTF-8 text; convert it, or give the file meant") from None
        if isinstance(data, dict):  # {"data": [...]} or {"id": {...}, ...}
            data = data.get("data", data.get("rows", list(data.values())))
        for i, record in enumerate(data, start=1):
            yield i, record
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError: a file cut short, or not Parquet
            raise DataError(f"{path} is not a readable Parquet file (cut short, or another format: "
                            f"{e.__class__.__name__}); give a complete Parquet file") from None
        for i, record in enumerate(table.to_pylist(), start=1):
            yield i, record
    else:
        raise DataError(f"{path}: unsupported dataset format {suffix!r}; use .jsonl, .json or .parquet")


def parse_row(record: Any, path: str | Path, line: int) -> Row:
    """Check one record of the common RL format and turn it into a Row, or raise RowError saying what is wrong."""
    if isinstance(record, RowError):
        raise record
    if not isinstance(record, dict):
        raise RowError(path, line, f"expected a JSON object, got {type(record).__name__}")
    for key in ("data_source", "prompt", "reward_model"):
        if key not in record:
            raise RowError(path, line, f"missing required field {key!r}")
    if not isinstance(record["data_source"], str) or not record["data_source"]:
        raise RowError(path, line, "field 'data_source' must be a non-empty string (it picks the verifier)")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if hasattr(prompt, "tolist"):  # numpy arrays from Parquet
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        raise RowError(path, line, "field 'prompt' must be a string or a non-empty list of {role, content} messages "
                                   "with string values")
    reward_model = record["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise RowError(path, line, "field 'reward_model' must be an object with a 'ground_truth' that is not null")
    extra_info = record.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise RowError(path, line, "field 'extra_info' must be an object")
    return Row(
        data_source=record["data_source"],
        prompt=[{"role": m["role"], "content": m["content"]} for m in prompt],
        ground_truth=reward_model["ground_truth"],
        ability=str(record.get("ability") or ""),
        extra_info=dict(extra_info),
    )


def load_rows(path: str | Path, strict: bool = False) -> tuple[list[Row], LoadReport]:
    """Load a dataset file; bad records are skipped and reported (or raised at once when strict)."""
    report = LoadReport(str(path))
    rows = []
    for line, record in iter_records(path):
        try:
            rows.append(parse_row(record, path, line))
        except RowError as err:
            if strict:
                raise
            report.skipped.append(err)
    report.loaded = len(rows)
    if report.skipped and not rows:  # every record skipped: the wrong file, or a converter's layout
        raise DataError(f"no record of {path} can be used ({len(report.skipped)} malformed; the first: "
                        f"{report.skipped[0]}); fix the file, or convert it (megaopd convert)")
    if report.skipped:
        log.warning(report.summary())
    return rows, report


def load_split(paths: list[str], strict: bool) -> list[Row]:
    """The rows of one split's files, in order."""
    rows = []
    for path in paths:
        loaded, report = load_rows(path, strict)
        rows += loaded
        log.info(report.summary())
    return rows


def write_rows(path: str | Path, rows: list[Row]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row.to_dict()) + "\n")
    tmp.replace(path)
