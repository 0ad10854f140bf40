"""Synthetic verifiable domains for the embedded default.

Each task has a difficulty knob and a worked solution of tens of tokens (steps, then ``answer:N``), because
per-token supervision is what OPD brings: with bare answers its advantage over GRPO mostly vanishes.

| data_source   | task                                   | difficulty           | example solution             |
|---------------|----------------------------------------|----------------------|------------------------------|
| arith_add     | column addition with carries           | digits per operand   | 7+8=15;4+3+1=8;answer:85     |
| arith_sub     | column subtraction (a >= b), borrows   | digits per operand   | 2-7+10=5;5-1-1=3;answer:35   |
| prog_trace    | trace a tiny straight-line program     | statements           | x=3;y=3*2=6;x=6+1=7;answer:7 |
| letter_count  | count one letter with a running tally  | string length        | a0b1b2c2;answer:2            |

arith_add also has longer wordings of the same steps (``verbosity`` 1 and 2: about 60 and 150 tokens at 2 digits)
for the response-length sweep: same problems, same answers, only the worked solution grows.

Train and held-out problems are split by a hash of the problem's canonical key, so the two sets are disjoint by
construction. The held-out problems are one stream of distinct problems, fixed by the seed, cut into the test rows
(first: the rows the single held-out file held before there was a validation split) and the validation rows after
them, so validation and test are disjoint too (a test checks the written files).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable

from megaopd.data.rows import Row
from megaopd.errors import DataError

ANSWER_PREFIX = "answer:"


@dataclass(frozen=True)
class Problem:
    key: str  # canonical form; the split is decided by its hash
    prompt: str
    solution: str  # worked solution ending in "answer:<ground truth>"
    answer: str


def _digits(n: int, width: int) -> list[int]:
    return [(n // 10**i) % 10 for i in range(width)]  # least significant first


def make_add(rng: random.Random, digits: int, verbosity: int = 0) -> Problem:
    """Column addition; `verbosity` (0-2) words the same steps at about 20, 60 and 150 tokens for 2 digits."""
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    steps, carry = [], 0
    for place, (x, y) in enumerate(zip(_digits(a, digits), _digits(b, digits))):
        total = x + y + carry
        steps.append(_add_step(place, x, y, carry, total, verbosity))
        carry = total // 10
    answer = str(a + b)
    if verbosity == 2:
        steps.append(f"no column is left, so {a} plus {b} is {answer}")
    return Problem(f"{a}+{b}", f"add {a}+{b}", ";".join(steps) + f";{ANSWER_PREFIX}{answer}", answer)


PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands")


def _add_step(place: int, x: int, y: int, carry: int, total: int, verbosity: int) -> str:
    name = PLACES[place] if place < len(PLACES) else f"column {place + 1}"
    if verbosity == 0:
        return f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}"
    if verbosity == 1:
        return f"{name} {x}+{y}" + (f"+{carry}" if carry else "") + f"={total} write {total % 10} carry {total // 10}"
    return (f"{name} digit: {x} plus {y}" + (f" plus carry {carry}" if carry else "") + f" is {total}, "
            f"write {total % 10} and carry {total // 10}")


def make_sub(rng: random.Random, digits: int) -> Problem:
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    a, b = sorted((rng.randint(lo, hi), rng.randint(lo, hi)), reverse=True)
    steps, borrow = [], 0
    for x, y in zip(_digits(a, digits), _digits(b, digits)):
        lend = 1 if x - borrow < y else 0
        value = x - borrow - y + 10 * lend
        steps.append(f"{x}-{y}" + ("-1" if borrow else "") + ("+10" if lend else "") + f"={value}")
        borrow = lend
    answer = str(a - b)
    return Problem(f"{a}-{b}", f"subtract {a}-{b}", ";".join(steps) + f";{ANSWER_PREFIX}{answer}", answer)


_OPS: dict[str, Callable[[int, int], int]] = {"+": lambda u, v: u + v, "-": lambda u, v: u - v,
                                              "*": lambda u, v: u * v}


def make_trace(rng: random.Random, statements: int) -> Problem:
    """A straight-line program over x, y, z with values kept in 0..99 so every step is a short number."""
    while True:
        env = {"x": rng.randint(1, 9)}
        code, trace = [f"x={env['x']}"], [f"x={env['x']}"]
        for _ in range(statements - 1):
            target = rng.choice("xyz")
            source = rng.choice(sorted(env))
            op = rng.choice("+-*")
            const = rng.randint(1, 9) if op != "*" else rng.randint(2, 3)
            value = _OPS[op](env[source], const)
            if not 0 <= value <= 99:
                break
            code.append(f"{target}={source}{op}{const}")
            trace.append(f"{target}={env[source]}{op}{const}={value}")  # substitute, then compute: one op a step
            env[target] = value
        else:
            out = rng.choice(sorted(env))
            program = ";".join(code) + f";print({out})"
            answer = str(env[out])
            return Problem(program, program, ";".join(trace) + f";{ANSWER_PREFIX}{answer}", answer)


def make_count(rng: random.Random, length: int) -> Problem:
    letters = "abcd"
    text = "".join(rng.choice(letters) for _ in range(length))
    target = rng.choice(letters)
    tally, steps = 0, []
    for ch in text:
        tally += ch == target
        steps.append(f"{ch}{tally}")
    answer = str(tally)
    return Problem(f"{target}:{text}", f"count {target} in {text}", "".join(steps) + f";{ANSWER_PREFIX}{answer}",
                   answer)


@dataclass(frozen=True)
class Domain:
    name: str  # the rows' data_source and the multi-teacher routing key
    ability: str
    make: Callable[..., Problem]  # (rng, difficulty[, verbosity]) -> Problem
    default_difficulty: int
    max_verbosity: int = 0  # the worked solution's wordings: same problems and answers, longer solutions


DOMAINS: dict[str, Domain] = {
    d.name: d
    for d in (
        Domain("arith_add", "arithmetic", make_add, 2, max_verbosity=2),
        Domain("arith_sub", "arithmetic", make_sub, 2),
        Domain("prog_trace", "code", make_trace, 3),
        Domain("letter_count", "string", make_count, 8),
    )
}


def is_heldout(key: str, heldout_percent: int) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 100 < heldout_percent


SPLITS = ("train", "validation", "test")
# The held-out splits in the order they are cut from the stream of distinct held-out problems.
HELDOUT_SPLITS = ("test", "validation")


def make_splits(domain: str, counts: dict[str, int], difficulty: int | None = None, seed: int = 0,
                heldout_percent: int = 10, verbosity: int = 0) -> dict[str, list[Row]]:
    """Rows of the splits in `counts` (split -> rows). Held-out rows are distinct problems; train rows may repeat a
    problem. Validation rows are the held-out problems after the test rows, so `counts` names the test rows too.

    `verbosity` changes only the worked solutions' wording (the length sweep): the problems, their split and
    answers are those of verbosity 0."""
    spec = DOMAINS[domain]
    difficulty = difficulty or spec.default_difficulty
    if not 0 <= verbosity <= spec.max_verbosity:
        raise ValueError(f"{domain}: verbosity must be in 0..{spec.max_verbosity}, got {verbosity} "
                         f"(only arith_add has longer worded solutions)")
    extra = {"verbosity": verbosity} if verbosity else {}
    return split_rows(domain, spec.ability, lambda rng: spec.make(rng, difficulty, **extra), counts, seed,
                      heldout_percent, difficulty)


def make_split(domain: str, split: str, count: int, difficulty: int | None = None, seed: int = 0,
               heldout_percent: int = 10, verbosity: int = 0) -> list[Row]:
    """`count` rows of one split, train or test (validation follows the test rows: ``make_splits``)."""
    return make_splits(domain, {split: count}, difficulty, seed, heldout_percent, verbosity)[split]


def split_rows(domain: str, ability: str, make: Callable[[random.Random], Problem], counts: dict[str, int],
               seed: int, heldout_percent: int, difficulty: int) -> dict[str, list[Row]]:
    """Rows of the splits in `counts` from a problem maker: train from its own stream, test then validation cut
    from one stream of distinct held-out problems; which stream a problem belongs to is decided by its key's hash."""
    if set(counts) - set(SPLITS):
        raise ValueError(f"unknown split(s) {sorted(set(counts) - set(SPLITS))}; use {', '.join(SPLITS)}")
    if "validation" in counts and "test" not in counts:
        raise ValueError("validation rows are the held-out problems after the test rows: give the test count too")
    out = {}
    if "train" in counts:
        out |= _cut(domain, ability, make, "train", [("train", counts["train"])], seed, heldout_percent, difficulty)
    heldout = [(split, counts[split]) for split in HELDOUT_SPLITS if split in counts]
    if heldout:
        out |= _cut(domain, ability, make, "heldout", heldout, seed, heldout_percent, difficulty)
    return out


def _cut(domain: str, ability: str, make: Callable[[random.Random], Problem], stream: str,
         splits: list[tuple[str, int]], seed: int, heldout_percent: int, difficulty: int) -> dict[str, list[Row]]:
    """Draw the problems of one stream (train, or the distinct held-out ones) and cut them into `splits` in order."""
    rng = random.Random(f"{domain}/{difficulty}/{stream}/{seed}")
    want_heldout = stream == "heldout"
    count = sum(n for _, n in splits)
    problems, seen, attempts = [], set(), 0
    while len(problems) < count:
        attempts += 1
        if attempts > 200 * count:
            raise DataError(f"{domain} at difficulty {difficulty} has too few distinct {stream} problems for "
                            f"{count} rows; ask for fewer (make-embedded --train-rows / --validation-rows / "
                            "--heldout-rows, a study's assets.*_rows) or raise its difficulty (assets.difficulty)")
        problem = make(rng)
        if is_heldout(problem.key, heldout_percent) != want_heldout or (want_heldout and problem.key in seen):
            continue
        seen.add(problem.key)
        problems.append(problem)
    out, start = {}, 0
    for split, n in splits:
        out[split] = [Row(
            data_source=domain,
            prompt=[{"role": "user", "content": problem.prompt}],
            ground_truth=problem.answer,
            ability=ability,
            extra_info={"split": split, "index": i, "key": problem.key, "difficulty": difficulty,
                        "solution": problem.solution},
        ) for i, problem in enumerate(problems[start:start + n])]
        start += n
    return out


def corrupt(solution: str, rng: random.Random) -> str:
    """A noisy worked solution for the cold start: one character substituted or dropped, or the answer cut."""
    kind = rng.choice(("substitute", "drop", "truncate"))
    if kind == "truncate":
        cut = solution.rfind(ANSWER_PREFIX) + len(ANSWER_PREFIX)
        return solution[: rng.randint(cut, max(cut, len(solution) - 1))]
    i = rng.randrange(len(solution))
    if kind == "drop":
        return solution[:i] + solution[i + 1:]
    return solution[:i] + rng.choice("0123456789") + solution[i + 1:]
