"""Tiny GGUF checkpoints written with the gguf package, for `megaopd import-model`'s tests: a two-layer qwen2 model
(q/k/v biases, 2 KV heads) with a byte-level BPE tokenizer and ChatML special tokens, in seconds. Variants make the
files import must refuse (no chat template, an unknown architecture, a quantisation the gguf package cannot
dequantise) and the ways a GGUF stores a head: once (tied), twice (a tied embedding quantised two ways, as the Qwen
files do) or a different matrix (untied).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def byte_vocab() -> list[str]:
    """GPT-2's byte-level alphabet: each byte as the printable character the BPE vocabulary spells it with."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def write_gguf(path: Path, *, architecture: str = "qwen2", chat_template: str | None = CHATML,
               head: str = "twice", quant: str = "Q8_0") -> Path:
    """`head`: "tied" (no output.weight), "twice" (the embedding again, in F16 beside a `quant` embedding),
    "untied" (an independent matrix); `quant`: the embedding's and the layers' quantisation."""
    import gguf

    rng = np.random.default_rng(0)
    merges = ["Ġ t", "h e", "Ġt he"]  # a few, so the vocabulary is a BPE one (transformers rebuilds none)
    tokens = byte_vocab() + [m.replace(" ", "") for m in merges] + SPECIAL
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIAL)) + [3] * len(SPECIAL))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab - 3)
    writer.add_eos_token_id(vocab - 3)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    qtype = gguf.GGMLQuantizationType[quant]

    def add(name: str, shape: tuple[int, ...], as_type=None):
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if len(shape) == 1:  # norms and biases stay float32, as llama.cpp writes them
            data = 1.0 + data if name.endswith("norm.weight") else data
            writer.add_tensor(name, data)
            return data
        as_type = as_type or qtype
        try:
            packed = gguf.quants.quantize(data, as_type)
        except NotImplementedError:  # a type the gguf package cannot write (nor read): its blocks' bytes, zeroed
            block, size = gguf.GGML_QUANT_SIZES[as_type]
            packed = np.zeros((shape[0], shape[1] // block * size), dtype=np.uint8)
        writer.add_tensor(name, packed, raw_dtype=as_type)
        return data

    embedding = add("token_embd.weight", (vocab, HIDDEN))
    for i in range(LAYERS):
        q, kv = HIDDEN, HIDDEN // HEADS * KV_HEADS
        for name, shape in (("attn_norm.weight", (HIDDEN,)), ("attn_q.weight", (q, HIDDEN)), ("attn_q.bias", (q,)),
                            ("attn_k.weight", (kv, HIDDEN)), ("attn_k.bias", (kv,)), ("attn_v.weight", (kv, HIDDEN)),
                            ("attn_v.bias", (kv,)), ("attn_output.weight", (HIDDEN, q)),
                            ("ffn_norm.weight", (HIDDEN,)), ("ffn_gate.weight", (FFN, HIDDEN)),
                            ("ffn_up.weight", (FFN, HIDDEN)), ("ffn_down.weight", (HIDDEN, FFN))):
            add(f"blk.{i}.{name}", shape)
    add("output_norm.weight", (HIDDEN,))
    if head == "twice":
        writer.add_tensor("output.weight", embedding.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
    elif head == "untied":
        add("output.weight", (vocab, HIDDEN), gguf.GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
