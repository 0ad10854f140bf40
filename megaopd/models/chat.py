"""Prompt tokens from chat messages through the tokenizer's own chat template, for every engine and the trainer.

The local rollout engine, the SGLang engine and the SFT step all tokenise a row's ``prompt`` messages here, so the
prompt a policy is trained on is the prompt it sampled from, whichever engine sampled it.
"""

from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Prompt tokens through the tokenizer's own chat template, ending with the assistant header."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def chat_prompt_ids_batch(tokenizer, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """``chat_prompt_ids`` of many conversations: one batched template call, one batched tokenizer call."""
    texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]
