"""Where a math response states its final answer: the candidates a grader reads, in the order it tries them.

The order is the reference grader's (math-verify 0.9.0, read with ``\\boxed{}`` at its first priority as its own
regression tests and lighteval's MATH tasks read it), found by one scan of the response instead of its regexes,
which take tens of seconds on a response of "1 " or ``\\(`` repeated. Six priorities, best first:

| priority | what marks the answer | examples |
|---|---|---|
| marked | the last box (boxes written next to it join it, as a set); Minerva's answer sentence; GSM8K's ``####`` | ``\\boxed{7}``, ``Final Answer: The final answer is $7$. I hope it is correct.``, ``#### 7`` |
| final | "final answer ... is X" | ``The final answer is 7`` |
| labelled | "answer:" then X within 50 characters, or after the last "=" of its line | ``Answer: x = 7`` |
| answer | "answer" then X within 50 characters | ``so the answer is $7$`` |
| answer line | the rest of an "answer is" / "answer:" line in LaTeX without delimiters (ours) | ``The answer is \\sqrt{2}.`` |
| plain | any LaTeX span or number (flexible extraction only) | ``... which gives $\\frac{7}{2}$.`` |

X is a LaTeX span (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``, `` [..] ``, a bare ``\\frac{a}{b}``; up to six
joined by "and", "or" or ","), a number (``1,000.5``, ``1 000``, ``1000,99``, ``28%``, ``28 percent``, ``$5``) or
arithmetic on digits (``2/3``). Within a priority the candidate that ends last comes first; a grader takes the first
that parses. A number counts only after a space, "=" or a currency sign, so ``AZYUK2A`` holds none and no LaTeX is
cut down to a digit inside it; a response with no LaTeX span and no such number has no answer. Unicode math
(``−5``, ``√2``, ``x²``, ``3½``, ``30°``) is read as its LaTeX.

**Strict** extraction stops before "plain": only an answer the response marks counts (verl's GSM8K rule, widened
to the marks our prompts ask for). **Flexible** also reads the last span or number when none is marked (the
reference's own fallback, and lm-evaluation-harness's "flexible-extract" for GSM8K).

Everything here is linear in the response's length: it runs in the trainer's process, on model output.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from dataclasses import dataclass
from decimal import Decimal
from typing import Callable

from megaopd.data.answers import BOX, BOX_COMMANDS, LATEX_DELIMITERS, boxed_answer

LATEX, NUMBER, EXPR = "latex", "number", "expr"
STRICT, FLEXIBLE = "strict", "flexible"
MAX_CANDIDATES = 16  # a grader tries them in order; a response with more stated answers gets no more tries


@dataclass(frozen=True)
class Part:
    """One stated value: LaTeX source, a number in canonical form ("-1000.5", "3/4"), or digit arithmetic."""

    kind: str
    text: str
    percent: bool = False


Candidate = tuple[Part, ...]  # several parts ("$1$, $2$ and $3$") form a set
Hit = tuple[int, int, Candidate]  # where a candidate's match starts and ends: the later end is tried first

# ----------------------------------------------------------------------------------------------- Unicode math

# Unicode math that models write and neither the number patterns nor the LaTeX grammar read, as its LaTeX: the
# minus sign, pi, infinity, degrees, roots, vulgar fractions (½) and superscripts (x², 10⁻³).
_SYMBOLS = str.maketrans({"\u2212": "-", "π": "\\pi ", "∞": "\\infty ", "°": "^{\\circ}"})
_ROOT = re.compile(r"√\s*+(?:(\d++(?:\.\d++)?|[A-Za-z])|\(([^()\n]{1,100})\))?")
_SUPERSCRIPT = re.compile("[⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻]++")
_VULGAR_FRACTION = re.compile("[\u00bc-\u00be\u2150-\u215e]")


def _vulgar_fraction(match: re.Match) -> str:
    """½ as \\frac{1}{2}, from its Unicode decomposition ("<fraction> 0031 2044 0032")."""
    numerator, denominator = "".join(chr(int(code, 16)) for code in
                                     unicodedata.decomposition(match.group()).split()[1:]).split("\u2044")
    return f"\\frac{{{numerator}}}{{{denominator}}}"


def unicode_math(text: str) -> str:
    """``text`` with the Unicode math it writes spelled in LaTeX (√(10) is \\sqrt{10}, x² is x^{2}); linear."""
    if text.isascii():
        return text
    text = _SUPERSCRIPT.sub(lambda m: "^{" + unicodedata.normalize("NFKC", m.group()) + "}", text)
    text = _VULGAR_FRACTION.sub(_vulgar_fraction, text)
    text = _ROOT.sub(lambda m: "\\sqrt{" + (m.group(1) or m.group(2)) + "}" if m.lastindex else "\\sqrt", text)
    return text.translate(_SYMBOLS)


# ----------------------------------------------------------------------------------------------- numbers

# Scale words, each a power of ten: "2.5 million" is 2500000, never 2.5 with a unit.
SCALES = {"thousand": 3, "million": 6, "billion": 9, "trillion": 12}
_SCALE_WORD = "(?:" + "|".join(SCALES) + ")"
_EXPONENT = r"[eE][+-]?\d{1,2}"  # scientific notation's: 1.5e3, 6.02E-23
_PERCENT_WORD = r"(?:\\?%|[Pp]ercent(?:age)?|[Pp]ct)"  # after a number or an expression: 28%, 28 percent
_CURRENCY = "$€£¥₹₽₪₩₫฿₡₢₣₤₥₦₧₨₭₮₯₰₱₲₳₴₵₶₷₸₺₻₼₾₿"
# A number token: thousands groups of exactly three digits (comma or space), a decimal point or comma, or a bare
# integer; scientific notation's exponent (1.5e3, 6.02E-23), a scale word and a percent sign or word may follow. A
# power, subscript, LaTeX command or variable term written on it (2\sqrt{3}, 2^{10}, 2\pi, 2x+1), or a LaTeX operator
# after it (3 \times 5), continues an expression, so it is no number (degrees, units such as 12cm, spacing and
# closing delimiters may follow). Every repetition is bounded by what follows it, so this is linear.
_NUMBER = re.compile(r"""(?<!\d)(?:
      (?P<grouped>-?[1-9]\d{0,2}(?:[ ,]\d{3})++)(?![\d,])(?P<grouped_decimal>\.\d++)?
    | (?P<whole>-?\d++)(?P<decimal>[.,]\d++)
    | (?P<fraction>\.\d++)
    | (?P<integer>-?\d++)
    )(?P<exponent>""" + _EXPONENT + r"""(?!\d|\.\d))?
    (?P<scale>[ \t]++""" + _SCALE_WORD + r"""(?![A-Za-z]))?
    (?P<percent>[ \t]*+""" + _PERCENT_WORD + r""")?
    (?!\^(?!\{?\\circ)|_|\\(?!%|[,!;:\ \\)\]}$]|text|mbox|mathrm|quad|qquad|right|end|c?dots|ldots)
      |\s++\\(?:times|cdot|div|pm|mp)(?![a-zA-Z])|[A-Za-z]++(?:\^\{?\d++\}?)?\s*+[-+=(])
    """, re.VERBOSE)
# Where a stated value may start: the response's start, or whitespace or "=" (then bold "**", a currency sign);
# not after an operator, whose operand it is ("x + 5", "3 \times 5").
_START = r"(?:^|(?<![+×÷])(?<!\\times)(?<!\\cdot)(?<!\\div)(?<!\\pm)(?<!\\mp)[\s=])"
_VALUE_START = re.compile(rf"{_START}(?:\*\*)?[{re.escape(_CURRENCY)}]?(?=[-.(\d])")
_PLAIN_VALUE = re.compile(rf"{_START}(?:\*\*)?[{re.escape(_CURRENCY)}]?" + _NUMBER.pattern, re.VERBOSE)
# An answer on its own that is one number (commas only between groups of three), or a fraction of whole numbers.
_PLAIN_NUMBER = re.compile(r"(?:-?(?:\d{1,3}(?:,\d{3})++|\d++)(?:\.\d++)?|-?\.\d++)(?:" + _EXPONENT + r")?"
                           r"(?:[ \t]++" + _SCALE_WORD + r")?(?:\\?%)?")
MIXED_NUMBER = re.compile(r"(-?)(\d{1,6})[ \t]+(\d{1,6})/(\d{1,6})")  # "1 1/2" on one line: "11\n5/6" is two numbers
_DECIMAL_COMMA = re.compile(r"-?\d++,\d++(?:\\?%)?")
_PLAIN_FRACTION = re.compile(r"(-?)(?:\\[dt]?frac\{(?P<numerator>\d{1,50})\}\{(?P<denominator>\d{1,50})\}"
                             r"|(?P<over>\d{1,50})/(?P<under>\d{1,50}))")


def number_part(match: re.Match) -> Part:
    """The canonical Part of a ``_NUMBER`` match: separators dropped, a decimal comma made a point, an exponent
    and a scale word applied (1.5e3 and 1.5 thousand are 1500)."""
    whole = match["grouped"] or match["whole"] or match["integer"] or ""
    decimal = (match["grouped_decimal"] or match["decimal"] or match["fraction"] or "").replace(",", ".")
    sign = "-" if whole.startswith("-") else ""
    digits = whole.lstrip("-").replace(",", "").replace(" ", "").lstrip("0") or "0"
    text = f"{sign}{digits}{decimal}"
    if match["exponent"] or match["scale"]:
        exponent = int(match["exponent"][1:]) if match["exponent"] else 0
        exponent += SCALES[match["scale"].strip()] if match["scale"] else 0
        text = format(Decimal(text).scaleb(exponent), "f")
    return Part(NUMBER, text, bool(match["percent"]))


# ----------------------------------------------------------------------------------------------- digit arithmetic

_EXPR_CHARS = r"[\d.\s+\-*×/^()÷]"
_EXPR_RUN = re.compile(rf"-?\(?-?\d{_EXPR_CHARS}{{0,200}}")  # bounded: an expression is a short run
# Where digit arithmetic may start: as a stated value, with an operator in the run after its first digit.
_EXPRESSION_START = re.compile(rf"(?:^|[\s=])(?:\*\*)?(?=-?\(?-?\d{_EXPR_CHARS}{{0,200}}?[+\-*×/^()÷])")
_LAST_CLOSER = re.compile(r".*[.)\s]", re.DOTALL)
_DIGIT = re.compile(r"\d")
_OPERATOR = re.compile(r"[+\-*×/^()÷]")
_DANGLING = " \t.+*×/^÷-"  # operators (and points, spaces) at a run's end, with nothing after them
_EXPRESSION_PERCENT = re.compile(r"[ \t]*+" + _PERCENT_WORD)


def _expression_at(text: str, start: int) -> tuple[int, Part] | None:
    """Digit arithmetic starting at ``start`` (``2/3``, ``(1/2) * 4``) and where its match ends: after the one
    character that must close it (space, ".", ",", ":", ")", "$" or the text's end), taken as late as possible."""
    run = _EXPR_RUN.match(text, start)
    if run is None:
        return None
    end = run.end()
    if end < len(text) and text[end] not in ",:$%":  # the run itself is not closed: end at its last closer
        closer = _LAST_CLOSER.match(text, start, end)
        if closer is None:
            return None
        end = closer.end() - 1
    body = text[start:end].rstrip(_DANGLING).strip()  # "18**" (Markdown bold after 18) is no arithmetic
    first_digit = _DIGIT.search(body).start()
    first_operator = _OPERATOR.search(body, first_digit + 1)
    if first_operator is None or first_operator.start() > len(body) - 2:  # an operator with something after it
        return None
    percent = _EXPRESSION_PERCENT.match(text, end)
    if percent:  # "4 4/9 %": the percent applies to the whole value
        return percent.end(), Part(EXPR, body, True)
    return end + (end < len(text)), Part(EXPR, body)


def _value_at(text: str, at: int, kinds: str = "en") -> tuple[int, Part] | None:
    """Digit arithmetic ("e") or a number ("n") whose required leading space or "=" is at ``at`` (or the text's
    start), and where its match ends."""
    start = at if at == 0 and not (text[:1].isspace() or text[:1] == "=") else at + 1
    if text.startswith("**", start):
        start += 2
    if "e" in kinds:
        found = _expression_at(text, start)
        if found:
            return found
    if "n" in kinds:
        if start < len(text) and text[start] in _CURRENCY:
            start += 1
        number = _NUMBER.match(text, start)
        if number:
            return number.end(), number_part(number)
    return None


def _all_expressions(text: str) -> list[Hit]:
    """Every digit expression with a space or "=" before it, none overlapping."""
    out, pos = [], 0
    while True:
        start = _EXPRESSION_START.search(text, pos)
        if start is None:
            return out
        found = _value_at(text, start.start(), "e")
        if found:
            out.append((start.start(), found[0], (found[1],)))
        pos = found[0] if found else start.start() + 1


def _last_numbers(text: str, keep: Callable[[int], bool]) -> list[Hit]:
    """The last ``MAX_CANDIDATES`` numbers with a space or "=" before them for which ``keep(end)`` holds."""
    kept = []
    for m in reversed(list(_PLAIN_VALUE.finditer(text))):
        if len(kept) == MAX_CANDIDATES:
            break
        if keep(m.end()):
            kept.append((m.start(), m.end(), (number_part(m),)))
    return kept


# ----------------------------------------------------------------------------------------------- LaTeX spans

# A bare fraction starts with the whole number written on it (3\frac{1}{2} is a mixed number, not a half); the
# lookbehind starts it only where a run of digits starts, so trying every opening stays linear.
_OPENERS = re.compile(r"\$|\\\[|\\\(|\s\[|(?<!\d)-?\d*+\\frac\{")
_FRACTION = re.compile(r"-?\d*+\\frac\{-?\d+(?:[.,]\d+)?\}\{-?\d+(?:[.,]\d+)?\}")
_PERCENT_AFTER = re.compile(rf"\s*+({_PERCENT_WORD})?")
_JOINER = re.compile(r"\s*+(?:,?and|,?or|,)\s*+")
_MAX_JOINED = 6  # the reference reads at most six spans joined by "and"/"or"/","


class _Spans:
    """The LaTeX spans of one text. Closing delimiters are found by bisecting sorted position lists, so trying a
    span at every opening costs O(log n), not a scan to the end of the text (what makes the reference quadratic)."""

    def __init__(self, text: str):
        self.text = text

        def where(pattern: str) -> list[int]:
            return [m.start() for m in re.finditer(pattern, text)]

        self.newlines = where(r"\n")
        self.dollars = where(r"(?<!\\)\$")  # unescaped
        self.double_dollars = where(r"(?=\$\$)")
        self.close_brackets = where(r"\\\]")
        self.close_parens = where(r"\\\)")
        self.square_closes = where(r"\]")
        self.square_opens = where(r"\[")
        self.regions = self._regions()

    def _regions(self) -> list[tuple[int, int]]:
        """Where the text is inside LaTeX delimiters, well-formed or not (a "$" span broken by a line too): a number
        there is part of LaTeX, never a plain number of its own."""
        regions, opened = [], None
        for m in re.finditer(r"(?<!\\)(?:\$\$?|\\[(\[)\]])", self.text):
            delimiter = m.group()
            if opened is None and delimiter in LATEX_DELIMITERS:
                opened = m.start(), LATEX_DELIMITERS[delimiter]
            elif opened is not None and delimiter == opened[1]:
                regions.append((opened[0], m.end()))
                opened = None
        return regions

    def inside(self, at: int) -> bool:
        """Whether ``at`` lies within delimited LaTeX."""
        i = bisect.bisect_right(self.regions, (at, len(self.text))) - 1
        return i >= 0 and self.regions[i][0] < at < self.regions[i][1]

    @staticmethod
    def _next(positions: list[int], at: int) -> int | None:
        i = bisect.bisect_left(positions, at)
        return positions[i] if i < len(positions) else None

    def _line_clear(self, start: int, end: int) -> bool:
        nl = self._next(self.newlines, start)
        return nl is None or nl >= end

    def _escaped(self, i: int) -> bool:
        return i > 0 and self.text[i - 1] == "\\"

    def span_at(self, q: int, boxed: bool = False) -> tuple[int, str] | None:
        """(end, content) of the span opening at ``q``; with ``boxed`` only a span holding a ``\\boxed{}``."""
        t = self.text
        found = None
        if q >= len(t):
            return None
        if t.startswith("$$", q) and not self._escaped(q):
            j = self._next(self.double_dollars, q + 2)
            if j is not None and j > q + 2 and t[j - 1] != "\\":
                found = j + 2, t[q + 2:j]
        elif t.startswith("\\[", q) and not self._escaped(q):
            j = self._next(self.close_brackets, q + 2)
            if j is not None and j > q + 2 and t[j - 1] != "\\":
                found = j + 2, t[q + 2:j]
        elif t.startswith("$", q) and not (q > 0 and (t[q - 1] == "\\" or t[q - 1].isdigit())):
            j = self._next(self.dollars, q + 1)
            if j is not None and j > q + 1 and self._line_clear(q, j):
                found = j + 1, t[q + 1:j]
        elif t.startswith("\\(", q) and not self._escaped(q):
            j = self._next(self.close_parens, q + 2)
            if j is not None and j > q + 2 and t[j - 1] != "\\" and self._line_clear(q, j):
                found = j + 2, t[q + 2:j]
        elif t[q].isspace() and t.startswith("[", q + 1):
            j = self._next(self.square_closes, q + 2)
            opens = self._next(self.square_opens, q + 2)
            if (j is not None and j > q + 2 and (opens is None or opens > j) and self._line_clear(q + 1, j)
                    and j + 1 < len(t) and t[j + 1].isspace()):
                found = j + 2, t[q + 2:j]
        elif not boxed:
            fraction = _FRACTION.match(t, q)
            if fraction:
                found = fraction.end(), fraction.group()
        if found and boxed and not _holds_box(found[1]):
            return None
        return found

    def joined_at(self, q: int, boxed: bool = False) -> tuple[int, Candidate] | None:
        """Up to six spans from ``q`` joined by "and"/"or"/",", each with an optional percent after it."""
        parts, end = [], q
        while len(parts) < _MAX_JOINED:
            span = self.span_at(end, boxed)
            if span is None:
                break
            percent = _PERCENT_AFTER.match(self.text, span[0])
            parts.append(bare(span[1], bool(percent.group(1))))
            end = percent.end()
            joiner = _JOINER.match(self.text, end)
            if joiner is None or joiner.end() >= len(self.text):
                break
            if self.span_at(joiner.end(), boxed) is None:
                break
            end = joiner.end()
        return (end, tuple(parts)) if parts else None

    def first_joined(self, start: int, limit: int, boxed: bool = False) -> Hit | None:
        """The first joined spans opening in [start, limit]."""
        for opener in _OPENERS.finditer(self.text, start, min(limit + 2, len(self.text))):
            if opener.start() > limit:
                return None
            found = self.joined_at(opener.start(), boxed)
            if found:
                return opener.start(), found[0], found[1]
        return None

    def all_joined(self, boxed: bool = False) -> list[Hit]:
        """Every run of joined spans, left to right, none overlapping."""
        out, pos = [], 0
        while True:
            found = self.first_joined(pos, len(self.text), boxed)
            if found is None:
                return out
            out.append(found)
            pos = found[1]


def _holds_box(content: str) -> bool:
    box = content.find("\\boxed{")
    return box >= 0 and content.find("}", box + 8) >= 0


# ----------------------------------------------------------------------------------------------- anchors

_FINAL_IS = re.compile(r"(?i:final answer is):?")
_I_HOPE = re.compile(r"\.?\s?I hope")
_MINERVA = re.compile(r"(?i:final answer is)[:\s]*+([^\n]{1,300}?)\.?\s?I hope")
_FINAL_ANSWER = re.compile(r"(?i:final answer)")
_IS = re.compile(r"\s++is:?")
_ANSWER_LABEL = re.compile(r"(?i:answer):")
_ANSWER_WORD = re.compile(r"(?i:answer)")
_GSM8K = re.compile(r"####[ \t]*+")
_ANSWER_LINE = re.compile(r"(?i:answer(?: is|:))[ \t:]*+([^\n]{1,300})")
_EQUALS_AHEAD = re.compile(r"\s*+=")
_SPACE = re.compile(r"\s*+")


def _skip_space(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()


def _value_after(text: str, at: int) -> tuple[int, Part] | None:
    """A value after optional whitespace at ``at``: its leading space is the last one (or an "=" at ``at``)."""
    after = _skip_space(text, at)
    if after > at:
        return _value_at(text, after - 1)
    return _value_at(text, at) if text.startswith("=", at) else None


def _sentences(text: str, spans: _Spans) -> list[Hit]:
    """ "The final answer is X. I hope it is correct." (Minerva's), X a span, a value, or bare LaTeX."""
    hits = []
    for m in _FINAL_IS.finditer(text):
        latex = spans.joined_at(_skip_space(text, m.end()))
        value = _value_after(text, m.end())
        for end, candidate in ([latex] if latex else []) + ([(value[0], (value[1],))] if value else []):
            hope = _I_HOPE.match(text, end)
            if hope:
                hits.append((m.start(), hope.end(), candidate))
    for m in _MINERVA.finditer(text):
        hits.append((m.start(), m.end() - 1, (bare(m.group(1).strip().strip("$")),)))
    return hits


_EMPTY_BOX = re.compile(r"(\\(?:" + "|".join(BOX_COMMANDS) + r"))\s*+\{\s*+\}")
_EMPTY = "\x00"  # stands for an empty box's content while the boxes are joined


def _boxes(text: str, spans: _Spans) -> list[Hit]:
    """The last box (as the reference's bare-box pattern: from the first box to the text's last "}"), and spans
    holding boxes."""
    hits = spans.all_joined(boxed=True) if "\\boxed{" in text else []
    first = BOX.search(text)
    answer = None
    if first:  # an empty box read with the boxes beside it leaves an empty member: "42," is no answer
        answer = boxed_answer(_EMPTY_BOX.sub(lambda m: m.group(1) + "{" + _EMPTY + "}", text))
        answer = answer.replace(_EMPTY, "") if answer is not None else None
    if answer is not None:
        hits.append((first.start(), max(text.rfind("}") + 1, first.end()), (bare(answer),)))
    return hits


def _gsm8k(text: str) -> list[Hit]:
    hits = []
    for m in _GSM8K.finditer(text):
        at = m.end() + (text[m.end():m.end() + 1] in _CURRENCY)
        number = _NUMBER.match(text, at)
        if number:
            hits.append((m.start(), number.end(), (number_part(number),)))
    return hits


def _final(text: str, spans: _Spans) -> list[Hit]:
    """ "final answer ... is X": the first " is" within 100 characters that X follows."""
    hits, pos = [], 0
    for m in _FINAL_ANSWER.finditer(text):
        if m.start() < pos:
            continue
        for is_ in _IS.finditer(text, m.end(), min(m.end() + 140, len(text))):
            if is_.start() > m.end() + 100:
                break
            latex = spans.joined_at(_skip_space(text, is_.end()))
            value = _value_at(text, is_.end()) if is_.end() < len(text) else None
            found = ([latex] if latex else []) + ([(value[0], (value[1],))] if value else [])
            if found:
                hits += [(m.start(), end, candidate) for end, candidate in found]
                pos = max(end for end, _ in found)
                break
    return hits


def _labelled(text: str, spans: _Spans, label: re.Pattern) -> list[Hit]:
    """ "answer[:] ... X": the first span within 50 characters; for a value, the one after the last "=" within
    100 characters of the same line, else the first within 50, unless an "=" follows it."""
    hits, pos = [], 0
    for m in label.finditer(text):
        if m.start() < pos:
            continue
        found = []
        latex = spans.first_joined(m.end(), m.end() + 50)
        if latex:
            found.append(latex)
        value = _value_in_line(text, m.end())
        if value:
            found.append((m.start(), value[0], (value[1],)))
        if found:
            hits += [(m.start(), end, candidate) for _, end, candidate in found]
            pos = max(end for _, end, _ in found)
    return hits


def _value_in_line(text: str, at: int) -> tuple[int, Part] | None:
    line_end = text.find("\n", at)
    line_end = len(text) if line_end < 0 else line_end
    equals = text.rfind("=", at, min(at + 101, line_end))
    while equals >= 0:  # after the last "=" that a value follows
        value = _value_after(text, equals + 1)
        if value and not _EQUALS_AHEAD.match(text, value[0]):
            return value
        equals = text.rfind("=", at, equals)
    for start in _VALUE_START.finditer(text, at, min(at + 56, len(text))):  # else the first within 50 characters
        if start.start() > min(at + 50, line_end):
            break
        value = _value_at(text, start.start())
        if value and not _EQUALS_AHEAD.match(text, value[0]):
            return value
    return None


def _answer_lines(text: str) -> list[Hit]:
    """The rest of an answer line written in LaTeX without delimiters ("The answer is \\sqrt{2}.", "... is 2^{10}"):
    read after every anchored form found nothing that parses, before any plain span or number."""
    hits = []
    for m in _ANSWER_LINE.finditer(text):
        content = m.group(1).strip().rstrip(".").strip().strip("$")
        if "\\" in content or "^" in content:
            hits.append((m.start(), m.end(), (bare(content),)))
    return hits


def _plain(text: str, spans: _Spans) -> list[Hit]:
    """Every LaTeX span, and every number or digit expression outside LaTeX delimiters."""
    def outside(end: int) -> bool:
        return not spans.inside(end - 1)

    expressions = [hit for hit in _all_expressions(text) if outside(hit[1])]
    return spans.all_joined() + expressions + _last_numbers(text, outside)


def candidates(response: str, extraction: str = FLEXIBLE) -> list[Candidate]:
    """The answers a response states, best first (see the module docstring); empty when it states none."""
    response = unicode_math(response)
    spans = _Spans(response)
    groups = [_sentences(response, spans) + _boxes(response, spans) + _gsm8k(response),
              _final(response, spans), _labelled(response, spans, _ANSWER_LABEL),
              _labelled(response, spans, _ANSWER_WORD), _answer_lines(response)]
    if extraction == FLEXIBLE:
        groups.append(_plain(response, spans))
    out: list[Candidate] = []
    for group in groups:
        for _, _, candidate in sorted(group, key=lambda hit: (-hit[1], hit[0])):
            if candidate not in out:
                out.append(candidate)
    return out[:MAX_CANDIDATES]


def bare(answer: str, percent: bool = False, decimal_comma: bool = False) -> Part:
    """An answer written on its own (a reference, a box's or a span's inside), ``percent`` when a percent sign
    follows it: a number when it is only one (thousands grouped by commas of exactly three digits; a fraction of
    whole numbers, ``\\frac{3}{4}`` or ``3/4``, as "3/4"), else LaTeX. With ``decimal_comma`` (a reference answer
    without delimiters, as the reference reads one) a comma not grouping thousands is a decimal comma: ``1,22`` is
    1.22, ``1,225`` is 1225; inside a box or a span ``1,22`` stays a pair, as the reference reads it. A mixed number
    (``7 3/4``) is digit arithmetic."""
    text = unicode_math(answer).strip()
    plain = _PLAIN_NUMBER.fullmatch(text) or (decimal_comma and _DECIMAL_COMMA.fullmatch(text))
    number = _NUMBER.fullmatch(text) if plain else None
    if number:
        part = number_part(number)
        return Part(NUMBER, part.text, part.percent or percent)
    if MIXED_NUMBER.fullmatch(text):  # "7 3/4": digit arithmetic, where a mixed number is read
        return Part(EXPR, text, percent)
    fraction = _PLAIN_FRACTION.fullmatch(text)
    if fraction and not percent and int(fraction["denominator"] or fraction["under"]) != 0:
        numerator, denominator = fraction["numerator"] or fraction["over"], fraction["denominator"] or fraction["under"]
        return Part(NUMBER, f"{fraction[1]}{int(numerator)}/{int(denominator)}")
    return Part(LATEX, text, percent)
