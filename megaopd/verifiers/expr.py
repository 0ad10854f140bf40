"""A grammar for code-like math answers (``sqrt(2)/2``, ``3x^2 + 1``) that builds sympy objects and runs nothing.

Model text never reaches ``eval``, ``sympify`` or ``parse_expr`` (all three evaluate Python). A whitelist tokenizer
admits numbers, ``+ - * / ^ **``, parentheses, a fixed table of functions and constants, and letters (a word that
is not in the table is the product of its letters, as ``xy`` is ``x*y``, unless a parenthesis follows it: a call
outside the table); anything else (quotes, dots after a name, underscores, brackets, commas, lambda) refuses the
whole answer. Juxtaposition multiplies (``2x``, ``2(x+1)``), except of two numbers (``11 7/6`` is refused, not
read as 77/6), and a function name applies to the atom after it (``sqrt 2``). Size limits keep a hostile answer from
costing the worker more than its timeout: a length and nesting cap, and no power whose exact value would be huge
(``9^9^9^9`` is refused before sympy computes anything).

    parse("sqrt(2)/2")   # sqrt(2)/2 as a sympy expression; Refused for anything outside the grammar
"""

from __future__ import annotations

import re

import sympy

MAX_LENGTH = 400  # characters: longer is no final answer
MAX_DEPTH = 40  # nested parentheses, unary signs and powers
MAX_POWER_BITS = 1 << 16  # an exact numeric power may have at most this many bits (about 20,000 digits)
MAX_EXPONENT = 1000  # of anything else

_FUNCTIONS = {"sqrt": sympy.sqrt, "exp": sympy.exp, "log": sympy.log, "ln": sympy.log, "sin": sympy.sin,
              "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec, "csc": sympy.csc,
              "asin": sympy.asin, "acos": sympy.acos, "atan": sympy.atan, "arcsin": sympy.asin,
              "arccos": sympy.acos, "arctan": sympy.atan, "sinh": sympy.sinh, "cosh": sympy.cosh,
              "tanh": sympy.tanh, "abs": sympy.Abs, "Abs": sympy.Abs}
_CONSTANTS = {"pi": sympy.pi, "E": sympy.E, "I": sympy.I, "oo": sympy.oo, "inf": sympy.oo, "infinity": sympy.oo}
_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|([A-Za-z]+)|(\*\*|[-+*/^()]))")


class Refused(ValueError):
    """The answer is outside the grammar or its limits; it equals nothing."""


def _tokens(text: str) -> list[tuple[str, str]]:
    if len(text) > MAX_LENGTH:
        raise Refused(f"longer than {MAX_LENGTH} characters")
    out, pos, text = [], 0, text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise Refused(f"unexpected character {text[pos]!r}")
        number, word, op = m.groups()
        if word is not None:
            if word in _FUNCTIONS or word in _CONSTANTS:
                out.append(("fn" if word in _FUNCTIONS else "const", word))
            elif len(word) > 1 and text[m.end():m.end() + 1] == "(":
                raise Refused(f"{word}(...) is not a function of the table")
            else:
                out.extend(("sym", letter) for letter in word)  # xy is x*y
        elif number is not None:
            if out and out[-1][0] == "num":
                raise Refused("two numbers side by side")  # "11 7/6" is no product
            out.append(("num", number))
        else:
            out.append(("op", "^" if op == "**" else op))
        pos = m.end()
    return out


def _power(base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    """base^exponent, refused where sympy would compute an exact number too large to hold: it expands
    Integer^Integer, sqrt(2)^(10^9) and (x+1)^n eagerly or under simplify."""
    if exponent.is_Number and abs(exponent) > 1:
        if base.is_Rational:
            bits = max(abs(base.p).bit_length(), abs(base.q).bit_length())
            if bits * abs(exponent) > MAX_POWER_BITS:
                raise Refused("a power too large to compute")
        elif abs(exponent) > MAX_EXPONENT:
            raise Refused(f"an exponent above {MAX_EXPONENT}")
    return sympy.Pow(base, exponent)


class _Parser:
    """Precedence climbing: sum := term (('+'|'-') term)*; term := unary (('*'|'/'|juxtaposed) unary)*;
    unary := ('-'|'+') unary | power; power := atom ('^' unary)?; atom := number | symbol | constant |
    '(' sum ')' | function ('(' sum ')' | atom)."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.i, self.depth = tokens, 0, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None or (value is not None and token[1] != value):
            raise Refused(f"expected {value or 'more'}")
        self.i += 1
        return token

    def nested(self, parse):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Refused(f"nested deeper than {MAX_DEPTH}")
        try:
            return parse()
        finally:
            self.depth -= 1

    def sum(self) -> sympy.Expr:
        value = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            sign = self.take()[1]
            right = self.term()
            value = value + right if sign == "+" else value - right
        return value

    def term(self) -> sympy.Expr:
        value = self.unary()
        while True:
            token = self.peek()
            if token in (("op", "*"), ("op", "/")):
                self.take()
                right = self.unary()
                if token[1] == "/" and right == 0:
                    raise Refused("division by zero")
                value = value * right if token[1] == "*" else value / right
            elif token is not None and (token[0] != "op" or token[1] == "("):  # 2x, 2(x+1), (a)(b)
                value = value * self.power()
            else:
                return value

    def unary(self) -> sympy.Expr:
        if self.peek() in (("op", "-"), ("op", "+")):
            sign = self.take()[1]
            value = self.nested(self.unary)
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.atom()
        if self.peek() == ("op", "^"):
            self.take()
            return _power(base, self.nested(self.unary))  # right-associative: 2^3^2 is 2^9
        return base

    def atom(self) -> sympy.Expr:
        kind, value = self.take()
        if kind == "num":
            return sympy.Rational(value) if "." in value else sympy.Integer(value)
        if kind == "sym":
            return sympy.Symbol(value)
        if kind == "const":
            return _CONSTANTS[value]
        if kind == "fn":
            argument = self.nested(self.atom)  # sqrt(2) and sqrt 2 alike
            return _FUNCTIONS[value](argument)
        if value == "(":
            inner = self.nested(self.sum)
            self.take(")")
            return inner
        raise Refused(f"unexpected {value!r}")


def parse(text: str) -> sympy.Expr:
    """The sympy expression ``text`` spells, built without evaluating any of it as code; Refused otherwise."""
    tokens = _tokens(text)
    if not tokens:
        raise Refused("empty")
    parser = _Parser(tokens)
    value = parser.sum()
    if parser.peek() is not None:
        raise Refused(f"unexpected {parser.peek()[1]!r}")
    return value
