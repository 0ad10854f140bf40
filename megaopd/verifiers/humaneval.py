"""HumanEval-style ``check(candidate)`` tests and MBPP-style top-level assertions, judged outside the candidate's
process.

The candidate's process only answers calls: it receives arguments, returns plain data (``wire``), and never sees
an expected value or runs a line of the test. Two ways to get the calls:

* **Split** (most of HumanEval and MBPP): a check whose body (or, for MBPP, whose module) is only
  ``assert candidate(ARGS) == EXPECTED``,
  ``assert candidate(ARGS)``, ``assert not candidate(ARGS)``, ``assert abs(candidate(ARGS) - EXPECTED) < TOL``
  (and no-ops), with literal arguments and expectations, becomes a list of :class:`Call`; the program answers
  them all in one process and the verifier compares here, as EvalPlus does.
* **Check process** (loops, helpers, computed inputs): the test runs unchanged in a second, trusted process whose
  ``candidate`` is a stub that sends each call's arguments to the program's process and returns its decoded reply.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaopd.verifiers import wire
from megaopd.verifiers.sandbox import Limits, Result, run_python

WIRE_SOURCE = Path(wire.__file__).read_text(encoding="utf-8")

# The program's side, main.py beside solution.py: answer one call per request line, in order. Its own reads see
# an empty stdin and its prints go to stderr, so neither can touch the exchange.
CALL_SERVER = WIRE_SOURCE + r'''
import os, runpy, sys
def _serve(name, method):
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    ns = runpy.run_path("solution.py", run_name="solution")
    fn = getattr(ns["Solution"](), name) if method and "Solution" in ns else ns[name]
    for line in requests:
        try:
            reply = "r" + dumps(fn(*loads(line)))
        except BaseException as e:
            reply = "e" + type(e).__name__
        replies.write(reply + "\n")
        replies.flush()
_serve(NAME, METHOD)
'''

# The trusted side of a check that cannot be split: runs the row's prompt (its helpers) and test, calling the
# program only through the stub; prints "pass" when check() returns.
CHECKER = WIRE_SOURCE + r'''
import builtins, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
verdict = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # the test's own prints cannot write the verdict
requests = os.fdopen(int(sys.argv[1]), "w", encoding="utf-8")
replies = os.fdopen(int(sys.argv[2]), "r", encoding="utf-8")
spec = json.loads(sys.stdin.read())
def candidate(*args):
    requests.write(dumps(list(args)) + "\n")
    requests.flush()
    line = replies.readline(1 << 20)
    if not line.endswith("\n"):
        raise RuntimeError("the program gave no answer")
    if line[0] == "r":
        return loads(line[1:-1])
    error = getattr(builtins, line[1:-1], None)
    raise error() if isinstance(error, type) and issubclass(error, Exception) else RuntimeError(line[1:-1])
ns = {"__name__": "__check__"}
# The test shares the solution's globals in HumanEval's and MBPP's harnesses: it sees the standard modules a
# solution imports (an MBPP test calls math.isclose) and the entry point by name.
exec("import collections, functools, heapq, itertools, math, operator, re, string, sys", ns)
exec(compile(spec["prompt"], "prompt.py", "exec"), ns)
ns[spec["entry_point"]] = candidate
exec(compile(spec["test"], "test.py", "exec"), ns)  # MBPP: top-level assertions run here
if "check" in ns:  # HumanEval: check(candidate)
    ns["check"](candidate)
verdict.write("pass\n")
'''


def call_server(name: str, method: bool) -> str:
    return CALL_SERVER.replace("NAME, METHOD", f"{name!r}, {method!r}")


@dataclass(frozen=True)
class Call:
    args: list
    expect: str  # "eq", "true", "false", "close" (abs(got - value) < tol), "close_eq" (<= tol)
    value: Any = None
    tol: float = 0.0


def parse_replies(result: Result, count: int) -> list[tuple[str, Any]]:
    """The program's replies, one per call: ("r", value), ("e", exception name) or ("bad", reason)."""
    replies = []
    for line in result.stdout.split("\n")[:count]:
        if line.startswith("r"):
            try:
                replies.append(("r", wire.loads(line[1:])))
            except wire.WireError as e:
                replies.append(("bad", str(e)))
        else:
            replies.append(("e", line[1:200]))
    return replies


def _literal(node: ast.AST) -> Any:
    return ast.literal_eval(node)


def _call_args(node: ast.AST, name: str) -> list | None:
    """The literal arguments of ``name(...)``, or None when ``node`` is not such a call."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
            and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)):
        return [_literal(a) for a in node.args]
    return None


def _split_assert(test: ast.AST, name: str) -> Call | None | bool:
    """A Call for one assertion; True for a no-op (``assert True``); None when it is not one we can split."""
    if isinstance(test, ast.Constant) and test.value is True:
        return True
    args = _call_args(test, name)
    if args is not None:
        return Call(args, "true")
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        args = _call_args(test.operand, name)
        return Call(args, "false") if args is not None else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if isinstance(op, ast.Eq):
        for call, other in ((left, right), (right, left)):
            args = _call_args(call, name)
            if args is not None:
                return Call(args, "eq", _literal(other))
        return None
    if isinstance(op, (ast.Lt, ast.LtE)) and isinstance(left, ast.Call) and isinstance(left.func, ast.Name) \
            and left.func.id == "abs" and len(left.args) == 1 and isinstance(left.args[0], ast.BinOp) \
            and isinstance(left.args[0].op, ast.Sub):
        args = _call_args(left.args[0].left, name)
        tol = _literal(right)
        if args is not None and isinstance(tol, (int, float)):
            return Call(args, "close" if isinstance(op, ast.Lt) else "close_eq", _literal(left.args[0].right), tol)
    return None


def split_check(test: str, entry_point: str) -> list[Call] | None:
    """The test's assertions as calls, or None when it does anything else (then it needs a process): the body of
    ``check(candidate)`` (HumanEval), else the top-level assertions on ``entry_point`` (MBPP)."""
    try:
        tree = ast.parse(test)
        check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
        if check is not None and len(check.args.args) != 1:
            return None
        name, body = (check.args.args[0].arg, check.body) if check else (entry_point, tree.body)
        calls = []
        for stmt in body:
            if isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                continue
            if not isinstance(stmt, ast.Assert):
                return None
            call = _split_assert(stmt.test, name)
            if call is None:
                return None
            if isinstance(call, Call):
                calls.append(call)
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def judge(call: Call, reply: tuple[str, Any]) -> bool:
    """Whether a reply satisfies the assertion it was split from, with Python's own semantics on plain data."""
    kind, got = reply
    if kind != "r":
        return False
    try:
        if call.expect == "eq":
            return bool(got == call.value)
        if call.expect == "true":
            return bool(got)
        if call.expect == "false":
            return not got
        diff = abs(got - call.value)
        return bool(diff < call.tol if call.expect == "close" else diff <= call.tol)
    except (TypeError, ValueError, OverflowError, ArithmeticError):
        return False


def run_split(program: str, entry: str, calls: list[Call], limits: Limits) -> bool:
    """Run all calls in one process; True when every reply passes."""
    requests = "".join(wire.dumps(list(c.args)) + "\n" for c in calls)
    result = run_python(call_server(entry, False), requests, limits, files={"solution.py": program})
    replies = parse_replies(result.raise_for_sandbox(), len(calls))
    return result.ok and len(replies) == len(calls) and all(map(judge, calls, replies))


def run_checker(program: str, spec: dict, limits: Limits) -> bool:
    """Run the test unchanged in a trusted process that calls the program through pipes; True when it passes."""
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    try:
        checker = subprocess.Popen([sys.executable, "-I", "-S", "-c", CHECKER, str(request_w), str(reply_r)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   pass_fds=(request_w, reply_r), start_new_session=True)
    except OSError:
        for fd in (request_r, request_w, reply_r, reply_w):
            os.close(fd)
        raise
    os.close(request_w)
    os.close(reply_r)
    try:
        try:
            task = {key: spec.get(key, "") for key in ("prompt", "test", "entry_point")}
            checker.stdin.write(json.dumps(task).encode())
        except BrokenPipeError:
            pass
        finally:
            try:
                checker.stdin.close()
            except BrokenPipeError:
                pass
        result = run_python(call_server(spec["entry_point"], False), request_r, limits,
                            files={"solution.py": program}, stdout=reply_w)
    finally:
        os.close(request_r)
        os.close(reply_w)
        try:  # its stdout holds the verdict only (a few bytes), so waiting before reading cannot deadlock
            checker.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            checker.kill()
            checker.wait()
        verdict = checker.stdout.read() if checker.returncode == 0 else b""
        checker.stdout.close()
    return result.raise_for_sandbox().ok and verdict == b"pass\n"
