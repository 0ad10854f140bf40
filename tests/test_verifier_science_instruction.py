"""Multiple-choice letters and IFEval-style instruction checks."""

import pytest

from megaopd.data.instructions import CHECKS, check_spec, followed
from megaopd.verifiers.instruction import score_instructions
from megaopd.verifiers.science import extract_choice, score_choice


@pytest.mark.parametrize("text, letter", [
    (r"... so it must be \boxed{C}", "C"),
    (r"\boxed{(B)}", "B"),
    ("The answer is (D).", "D"),
    ("Answer: A", "A"),
    ("**Answer:** B", "B"),
    ("b", "B"),
    ("(C)", "C"),
    ("Between (A) and (B), I pick (B)", "B"),
    ("I think it is about an answer, so...", None),
])
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


def test_letters_beyond_the_options_are_no_answer():
    assert extract_choice(r"\boxed{E}", num_choices=4) is None
    assert score_choice(r"\boxed{E}", "E", {"num_choices": 4}) == 0.0


def test_score_choice():
    assert score_choice("The answer is B", "B", {}) == 1.0
    assert score_choice("The answer is B", "C", {}) == 0.0
    assert score_choice("An apple is red.", "A", {}) == 0.0  # the article "An"/"A" is not a choice


def spec(*pairs):
    return {"instruction_id_list": [p[0] for p in pairs], "kwargs": [p[1] for p in pairs]}


@pytest.mark.parametrize("instruction, kwargs, good, bad", [
    ("punctuation:no_comma", {}, "No commas here.", "One, two."),
    ("change_case:english_lowercase", {}, "all lower", "Not lower"),
    ("change_case:english_capital", {}, "ALL CAPS", "Some caps"),
    ("keywords:existence", {"keywords": ["ocean", "tide"]}, "The Ocean has a tide.", "The ocean."),
    ("keywords:forbidden_words", {"forbidden_words": ["bad"]}, "badge is fine", "that is bad"),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "at least"}, "cat cat", "cat"),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "less than"}, "zoo", "zzz"),
    ("length_constraints:number_words", {"num_words": 3, "relation": "less than"}, "two words", "one two three"),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"}, "One. Two!", "Only one."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "a\n***\nb", "a\n***\nb\n***\nc"),
    ("length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"}, "First.\n\nThen more.", "First.\n\nNow."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] at [address]", "[name]"),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. bye", "Hi."),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n* b", "* a\n* b\n* c"),
    ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*a* and *b*", "*a* only"),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nx\nSection 2\ny", "Section 1\nx"),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1}"),
    ("detectable_format:title", {}, "<<Poem>>\ntext", "Poem\ntext"),
    ("combination:two_responses", {}, "one\n******\ntwo", "one\n******\none"),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "Say hi. Hi!", "Hi!"),
    ("startend:end_checker", {"end_phrase": "Is there anything else?"}, "Done. Is there anything else?", "Done."),
    ("startend:quotation", {}, '"quoted"', "not quoted"),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "less than"},
     "ONE word", "ONE TWO words"),
])
def test_each_instruction(instruction, kwargs, good, bad):
    assert followed(good, spec((instruction, kwargs))) == [True]
    assert followed(bad, spec((instruction, kwargs))) == [False]


def test_every_check_is_tested():
    tested = {case[0] for case in test_each_instruction.pytestmark[0].args[1]}
    assert tested == set(CHECKS)


def test_prompt_level_and_partial_credit():
    truth = spec(("punctuation:no_comma", {}), ("change_case:english_lowercase", {"capital_frequency": None}))
    assert score_instructions("fine text", truth, {}) == 1.0
    assert score_instructions("Fine text", truth, {}) == 0.0
    assert score_instructions("Fine text", truth, {"partial_credit": True}) == 0.5


@pytest.mark.parametrize("truth, problem", [
    ({"instruction_id_list": ["language:response_language"], "kwargs": [{"language": "fr"}]}, "unsupported"),
    ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]}, "one object per instruction"),
    ({"kwargs": []}, "instruction_id_list"),
    ({"instruction_id_list": [], "kwargs": []}, "empty"),
])
def test_bad_specs_are_rejected(truth, problem):
    with pytest.raises(ValueError, match=problem):
        check_spec(truth)


def test_bad_kwargs_are_a_data_error():
    with pytest.raises(ValueError, match="bad kwargs"):
        followed("x", spec(("keywords:existence", {"words": ["x"]})))
