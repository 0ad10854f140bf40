"""Arithmetic word problems in natural language with ``\\boxed{}`` answers, for real pretrained instruct models.

The synthetic domains (``synthetic.py``) ask for a terse ``answer:N`` that only a model trained here writes; a
published instruct model answers in sentences. These rows (data_source ``arith_word``, ability ``math``) are scored
by the math verifier, which reads the boxed answer, or the final number when there is none:

    Mia has 23 marbles and gets 45 more. How many marbles does Mia have now? Put the final answer in \\boxed{}.

Operands have ``digits`` digits (the difficulty); addition and subtraction, a >= b. Train and held-out problems are
split by the hash of (wording, operation, operands), as in the synthetic domains.
"""

from __future__ import annotations

import random
from pathlib import Path

from megaopd.data.rows import Row, write_rows
from megaopd.data.synthetic import Problem, split_rows

DOMAIN = "arith_word"
ASK = " Put the final answer in \\boxed{}."
NAMES = ("Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lena", "Ravi")
ITEMS = ("marbles", "apples", "stickers", "books", "coins", "cards")
# (wording, operation): {n} a name, {i} the items, {a} and {b} the operands (a >= b)
WORDINGS = (
    ("{n} has {a} {i} and gets {b} more. How many {i} does {n} have now?", "+"),
    ("A shop sold {a} {i} in the morning and {b} {i} in the afternoon. How many {i} did it sell in all?", "+"),
    ("{n} collected {a} {i} on Monday and {b} {i} on Tuesday. How many {i} is that altogether?", "+"),
    ("{n} had {a} {i} and gave {b} of them away. How many {i} are left?", "-"),
    ("A box holds {a} {i}. {n} takes {b} {i} out. How many {i} remain in the box?", "-"),
    ("{n} needs {a} {i} and already has {b}. How many more {i} does {n} need?", "-"),
)


def make_word_problem(rng: random.Random, digits: int) -> Problem:
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    a, b = sorted((rng.randint(lo, hi), rng.randint(lo, hi)), reverse=True)
    index = rng.randrange(len(WORDINGS))
    wording, op = WORDINGS[index]
    answer = str(a + b if op == "+" else a - b)
    text = wording.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b)
    return Problem(f"{index}:{a}{op}{b}", text + ASK, f"{a} {op} {b} = {answer}. The answer is \\boxed{{{answer}}}.",
                   answer)


def word_split(split: str, count: int, digits: int = 2, seed: int = 0, heldout_percent: int = 10) -> list[Row]:
    """`count` rows of one split, train or test."""
    return word_splits({split: count}, digits, seed, heldout_percent)[split]


def word_splits(counts: dict[str, int], digits: int = 2, seed: int = 0,
                heldout_percent: int = 10) -> dict[str, list[Row]]:
    return split_rows(DOMAIN, "math", lambda rng: make_word_problem(rng, digits), counts, seed, heldout_percent,
                      digits)


def build_word_problems(out_dir: str | Path, train_rows: int, heldout_rows: int, digits: int = 2, seed: int = 0,
                        heldout_percent: int = 10, validation_rows: int = 200) -> Path:
    """{out_dir}/arith_word/{train,validation,test}.jsonl (`heldout_rows`: the test rows); returns the domain's
    directory."""
    out = Path(out_dir) / DOMAIN
    counts = {"train": train_rows, "validation": validation_rows, "test": heldout_rows}
    for split, rows in word_splits(counts, digits, seed, heldout_percent).items():
        write_rows(out / f"{split}.jsonl", rows)
    return out
