"""Import-only stand-in for vllm's custom ops, for SGLang servers in CPU tests only (never on the GPU path).

SGLang's RoPE layer imports ``vllm._custom_ops.rotary_embedding`` on a plain CPU platform but never calls it;
raising here proves that.
"""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError("vllm rotary_embedding is not available in CPU tests")
