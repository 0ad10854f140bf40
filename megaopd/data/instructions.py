"""IFEval's instructions: each instruction id a row's ground truth may name, and the check that decides whether a
response follows it.

``ground_truth`` is ``{"instruction_id_list": ["punctuation:no_comma", ...], "kwargs": [{...}, ...]}``, one kwargs
object per instruction, with IFEval's argument names (``None`` values are ignored, as IFEval stores them). All
IFEval instruction ids are supported except ``language:response_language`` (it needs a language detector).

One home for both sides: the IFEval converter (``megaopd.data.sources``) runs every check once on an empty response,
so unknown ids and bad kwargs fail at load time instead of scoring 0 forever, and the instruction-following verifier
(``megaopd.verifiers.instruction``) scores responses with the same table.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable


def _compare(count: int, relation: str, target: int) -> bool:
    if relation == "less than":
        return count < target
    if relation == "at least":
        return count >= target
    raise ValueError(f"unknown relation {relation!r} (IFEval uses 'less than' or 'at least')")


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+\b", text)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if re.search(r"\w", s)]


def _paragraphs(text: str, separator: str) -> list[str]:
    return [p for p in re.split(separator, text.strip()) if p.strip()]


def _no_empty_paragraph(text: str, separator: str) -> bool:
    parts = re.split(separator, text.strip())
    return all(p.strip() for p in parts)


def _json(text: str) -> bool:
    # The fences by hand: re.sub(r"\s*```$") tried every whitespace run to its end, quadratic in whitespace.
    body = text.strip()
    if body.startswith("```"):
        body = body[3 + 4 * (body[3:7].lower() == "json"):].lstrip()
    if body.endswith("```"):
        body = body[:-3].rstrip()
    try:
        json.loads(body)
    except (ValueError, RecursionError):  # a deeply nested reply is no error of the verifier's
        return False
    return True


def _titles(text: str) -> list[str]:
    """What re.findall(r"<<([^\n]+?)>>", text) finds, in linear time (that regex rescans a line per "<<")."""
    out = []
    for line in text.split("\n"):
        start = line.find("<<")
        while start >= 0:
            end = line.find(">>", start + 3)
            if end < 0:
                break
            out.append(line[start + 2:end])
            start = line.find("<<", end + 2)
    return out


def _nth_paragraph(text: str, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    paragraphs = _paragraphs(text, r"\n\s*\n")
    if len(paragraphs) != num_paragraphs or not 1 <= nth_paragraph <= len(paragraphs):
        return False
    words = _words(paragraphs[nth_paragraph - 1])
    return bool(words) and words[0].lower() == first_word.lower()


def _sections(text: str, section_spliter: str, num_sections: int) -> bool:
    return len(re.split(rf"\s?{re.escape(section_spliter)}\s?\d+\s?", text)) - 1 >= num_sections


def _capital_words(text: str, capital_frequency: int, capital_relation: str) -> bool:
    return _compare(sum(w.isupper() for w in _words(text)), capital_relation, capital_frequency)


# instruction id -> check(response, **kwargs); the kwargs names are IFEval's.
CHECKS: dict[str, Callable[..., bool]] = {
    "keywords:existence": lambda r, keywords: all(re.search(re.escape(k), r, re.IGNORECASE) for k in keywords),
    "keywords:frequency": lambda r, keyword, frequency, relation: _compare(
        len(re.findall(re.escape(keyword), r, re.IGNORECASE)), relation, frequency),
    "keywords:forbidden_words": lambda r, forbidden_words: not any(
        re.search(rf"\b{re.escape(w)}\b", r, re.IGNORECASE) for w in forbidden_words),
    "keywords:letter_frequency": lambda r, letter, let_frequency, let_relation: _compare(
        r.lower().count(letter.lower()), let_relation, let_frequency),
    "length_constraints:number_sentences": lambda r, num_sentences, relation: _compare(
        len(_sentences(r)), relation, num_sentences),
    "length_constraints:number_paragraphs": lambda r, num_paragraphs: (
        len(_paragraphs(r, r"\s?\*\*\*\s?")) == num_paragraphs and _no_empty_paragraph(r, r"\s?\*\*\*\s?")),
    "length_constraints:number_words": lambda r, num_words, relation: _compare(len(_words(r)), relation, num_words),
    "length_constraints:nth_paragraph_first_word": _nth_paragraph,
    # [^[\]\n]: the same count as IFEval's \[.*?\] (each "]" closes at most one), without rescanning a line per "["
    "detectable_content:number_placeholders": lambda r, num_placeholders: len(
        re.findall(r"\[[^[\]\n]*\]", r)) >= num_placeholders,
    # IFEval's \s*MARKER.*$ finds the same as MARKER alone; its leading \s* made a search quadratic in whitespace
    "detectable_content:postscript": lambda r, postscript_marker: bool(re.search(
        r"p\.\s?p\.\s?s" if postscript_marker.upper() == "P.P.S" else re.escape(postscript_marker), r, re.IGNORECASE)),
    "detectable_format:number_bullet_lists": lambda r, num_bullets: len(
        # [^\S\n]: IFEval's \s* also crossed lines (the same count, but a search quadratic in blank lines)
        re.findall(r"^[^\S\n]*[*-][^*-].*$", r, re.MULTILINE)) == num_bullets,
    "detectable_format:constrained_response": lambda r: any(
        option in r for option in ("My answer is yes.", "My answer is no.", "My answer is maybe.")),
    "detectable_format:number_highlighted_sections": lambda r, num_highlights: len(
        [h for h in re.findall(r"\*[^\n*]*\*", r) + re.findall(r"\*\*[^\n*]*\*\*", r) if h.strip("* ")]
    ) >= num_highlights,
    "detectable_format:multiple_sections": _sections,
    "detectable_format:json_format": _json,
    "detectable_format:title": lambda r: any(t.strip() for t in _titles(r)),
    "combination:two_responses": lambda r: (
        len(parts := [p.strip() for p in r.split("******")]) == 2 and all(parts) and parts[0] != parts[1]),
    "combination:repeat_prompt": lambda r, prompt_to_repeat: r.strip().lower().startswith(
        prompt_to_repeat.strip().lower()),
    "startend:end_checker": lambda r, end_phrase: r.strip().lower().endswith(end_phrase.strip().lower()),
    "startend:quotation": lambda r: len(r.strip()) > 1 and r.strip()[0] == r.strip()[-1] == '"',
    "change_case:capital_word_frequency": _capital_words,
    "change_case:english_capital": lambda r: r.isupper(),
    "change_case:english_lowercase": lambda r: r.islower(),
    "punctuation:no_comma": lambda r: "," not in r,
}


def check_spec(ground_truth: Any) -> tuple[list[str], list[dict]]:
    """(instruction ids, kwargs without None values), or ValueError naming what is wrong."""
    spec = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(spec, dict) or not isinstance(spec.get("instruction_id_list"), list):
        raise ValueError("instruction ground truth needs an 'instruction_id_list' list")
    ids = [str(i) for i in spec["instruction_id_list"]]
    if not ids:
        raise ValueError("'instruction_id_list' is empty")
    kwargs = spec.get("kwargs") or [{} for _ in ids]
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise ValueError(f"'kwargs' must be a list with one object per instruction ({len(ids)})")
    unknown = [i for i in ids if i not in CHECKS]
    if unknown:
        raise ValueError(f"unsupported instruction ids {unknown}")
    return ids, [{k: v for k, v in (kw or {}).items() if v is not None} for kw in kwargs]


def followed(response: str, ground_truth: Any) -> list[bool]:
    """Whether each instruction is followed, in order."""
    ids, kwargs = check_spec(ground_truth)
    results = []
    for instruction, kw in zip(ids, kwargs):
        try:
            results.append(bool(CHECKS[instruction](response, **kw)))
        except TypeError as e:  # wrong or missing kwargs is a data error, not a failed response
            raise ValueError(f"{instruction}: bad kwargs {kw} ({e})") from e
    return results
