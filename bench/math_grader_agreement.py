"""Agreement of the math verifier with the reference grader (math-verify 0.9.0) on the reference's own regression
cases: every parametrized (gold, pred, expected) case of its test suite, graded once by its own test function and
once by ``megaopd.verifiers.math.score_math(pred, gold, extra_info)`` with the case's settings (``precision``;
``strict`` and ``allow_set_relation_comp`` are passed along, and ignored by our grader).

    pip download --no-deps --no-binary :all: math-verify==0.9.0 && tar xzf math_verify-0.9.0.tar.gz
    python bench/math_grader_agreement.py math_verify-0.9.0/tests [--show]

Prints how many of the cases math-verify grades as expected we grade the same, how many right answers we refuse
and how many cases expected to fail we pay. The reference's tests are trusted code: they call math-verify's
expression parser (sympy's ``parse_expr``) on their own strings, never on model output. ``--smoke`` runs two made-up
cases in the same layout (no download).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaopd.verifiers.math import score_math  # noqa: E402

SETTINGS = ("precision", "strict", "allow_set_relation_comp")
SMOKE_TESTS = '''import pytest

@pytest.mark.parametrize("gold,pred,expected", [("$\\\\frac{1}{2}$", "so $0.5$", 1), ("2", "AZYUK2A", 0)])
def test_smoke(gold, pred, expected):
    assert (gold, pred) in {("$\\\\frac{1}{2}$", "so $0.5$"), ("2", "AZYUK2A")}
'''


def cases(tests_dir: Path):
    """(id, test function, parameters) of every parametrized case with a gold and a pred."""
    sys.path.insert(0, str(tests_dir.parent))
    for path in sorted(tests_dir.glob("test_*.py")):
        module = importlib.import_module(f"{tests_dir.name}.{path.stem}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            for mark in getattr(fn, "pytestmark", []) if fn.__module__ == module.__name__ else []:
                names = [a.strip() for a in mark.args[0].split(",")] if mark.name == "parametrize" else []
                if "gold" in names and "pred" in names:
                    for i, values in enumerate(mark.args[1]):
                        yield f"{path.stem}::{name}[{i}]", fn, dict(zip(names, values))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests_dir", type=Path, nargs="?")
    parser.add_argument("--show", action="store_true", help="list every case graded differently")
    parser.add_argument("--smoke", action="store_true", help="two made-up cases in the reference's layout")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tests_dir = Path(tempfile.mkdtemp()) / "smoke_tests"
        args.tests_dir.mkdir()
        (args.tests_dir / "test_smoke.py").write_text(SMOKE_TESTS)
    if args.tests_dir is None:
        parser.error("give the reference's tests directory (see the module docstring), or --smoke")
    start, rows = time.time(), []
    for case_id, fn, params in cases(args.tests_dir.resolve()):
        try:
            fn(**params)
            reference_right = True
        except AssertionError:
            reference_right = False
        expected = int(params.get("expected", params.get("result")))
        ours = score_math(params["pred"], params["gold"], {k: params[k] for k in SETTINGS if k in params})
        rows.append((case_id, expected, reference_right, ours, params))
    right = [r for r in rows if r[2]]
    differ = [r for r in right if int(r[3]) != r[1]]
    paid = [r for r in rows if r[1] == 0 and r[3] == 1.0]
    print(f"cases: {len(rows)}; graded as expected by the reference: {len(right)}; graded the same here: "
          f"{len(right) - len(differ)} ({(len(right) - len(differ)) / max(len(right), 1):.1%}); right answers "
          f"refused: {sum(r[1] == 1 for r in differ)}; expected-to-fail cases paid: {len(paid)} "
          f"({time.time() - start:.0f} s)")
    for case_id, expected, _, _, params in differ if args.show else []:
        print(f"  {case_id} expected {expected}: gold {params['gold'][-70:]!r} pred {params['pred'][-90:]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
