"""HF <-> megatron-core through mbridge: build a GPT model from an HF directory's config, load its weights into
the local TP/PP shard, and export the (gathered) weights back as an HF model directory.

mbridge supplies the name maps and the QKV / gate-up layouts for Qwen3 and Llama. Four adaptations live here,
in a subclass of the bridge mbridge picks (nothing of mbridge is patched):

* the layer spec: mbridge hard-codes Transformer Engine; without TE we take megatron's local spec, whose norms
  are separate modules (``input_layernorm``, ``pre_mlp_layernorm``), renamed to the TE-fused names mbridge maps,
  and whose core attention can run a shared-prompt layout (``megaopd.models.megatron.shared_prompt``);
* tied embeddings: mbridge's Qwen2 bridge rewrites its *class* map when a config is tied (so a later untied model
  of the same class would load ``lm_head`` from the embedding) and Llama's never does; we keep the map per bridge;
* ``rope_theta``: transformers 5 moved it into ``rope_parameters``; mbridge still reads the attribute;
* the vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp`` like Megatron-LM does; the
  padded rows are zero and ``megaopd.models.megatron.vocab`` masks them out of every softmax.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

# Local (non-TE) spec module names -> the TE-fused names in mbridge's maps (megatron's own
# sharded_state_dict_keys_map does the same renaming for dist checkpoints).
_LOCAL_TO_FUSED = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def _hf_config(path: str | Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "rope_theta", None) is None:
        config.rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return config


def _bridge_class(model_type: str):
    from mbridge.core.bridge import _MODEL_REGISTRY

    if model_type not in _MODEL_REGISTRY:
        raise ValueError(f"mbridge has no bridge for model_type={model_type!r}; known: {sorted(_MODEL_REGISTRY)}")
    base = _MODEL_REGISTRY[model_type]

    class MegaopdBridge(base):
        def _adjust_mapping_for_shared_weights(self):
            tied = getattr(self.hf_config, "tie_word_embeddings", False)
            self._DIRECT_MAPPING = {**type(self)._DIRECT_MAPPING,
                                    "output_layer.weight": "model.embed_tokens.weight" if tied else "lm_head.weight"}

        def _get_hf_shared_weight_keys(self):
            return ["model.embed_tokens.weight"] if getattr(self.hf_config, "tie_word_embeddings", False) else []

        def _get_transformer_layer_spec(self, vp_stage=None):
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            from megaopd.models.megatron.shared_prompt import segment_attention_spec

            spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=self.use_te, vp_stage=vp_stage)
            return spec if self.use_te else segment_attention_spec(spec)

        def _weight_name_mapping_mcore_to_hf(self, name):
            for local, fused in _LOCAL_TO_FUSED.items():
                if name.endswith(local):
                    name = name[: -len(local)] + fused
            return super()._weight_name_mapping_mcore_to_hf(name)

    MegaopdBridge.__name__ = f"Megaopd{base.__name__}"
    return MegaopdBridge


def make_bridge(path: str | Path, dtype: torch.dtype, parallel_states, use_te: bool, vocab_multiple: int,
                **config_overrides):
    """An mbridge bridge for the HF directory `path` with our config overrides on megatron's TransformerConfig."""
    hf_config = _hf_config(path)
    cls = _bridge_class(hf_config.model_type)
    bridge = cls.__new__(cls)
    bridge.use_te = use_te
    cls.__init__(bridge, hf_config, dtype=dtype, parallel_states=parallel_states,
                 make_vocab_size_divisible_by=vocab_multiple * parallel_states.tp_size)
    bridge.set_extra_args(**config_overrides)
    return bridge


def build_models(bridge, pg_collection=None) -> list[torch.nn.Module]:
    """The local pipeline stage(s) of the GPT model (a list, one per virtual stage), fp32/bf16, not yet wrapped."""
    from megatron.core.models.gpt import GPTModel

    mpu = bridge.mpu
    provider = bridge._model_provider([])
    tied = getattr(bridge.hf_config, "tie_word_embeddings", False)
    pre, post = mpu.pp_rank == 0, mpu.pp_rank == mpu.pp_size - 1
    if pg_collection is None:
        model = provider(pre_process=pre, post_process=post)
    else:
        # A model on its own process groups (a teacher beside the student): same provider arguments.
        spec = bridge._get_transformer_layer_spec()
        args = bridge._get_gptmodel_args()
        bridge.vocab_size = args["vocab_size"]
        multiple = bridge.make_vocab_size_divisible_by
        bridge.padded_vocab_size = int(math.ceil(bridge.vocab_size / multiple) * multiple)
        args["vocab_size"] = bridge.padded_vocab_size
        model = GPTModel(config=bridge.config, transformer_layer_spec=spec, pre_process=pre, post_process=post,
                         share_embeddings_and_output_weights=tied, pg_collection=pg_collection, **args)
    from megatron.core import tensor_parallel

    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return [model.to(device)]


def export_state_dict(bridge, models: list[torch.nn.Module], keep: bool = True) -> dict[str, torch.Tensor]:
    """The full HF state dict (gathered over TP and PP; collective), on every rank that `keep`s it (the others only
    take part in the gathers, and get {}); tied output weights dropped."""
    state = {}
    for name, tensor in bridge.export_weights(models):
        if keep:
            state[name] = tensor.detach().to("cpu", torch.float32 if tensor.dtype == torch.float32 else tensor.dtype)
    if getattr(bridge.hf_config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def hf_model_from_state(bridge, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """An HF model built from the bridge's HF config and an exported state dict (strict: every weight present)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(bridge.hf_config, dtype=dtype, attn_implementation="sdpa")
    load_exact(bridge, model, state)
    if bridge.hf_config.tie_word_embeddings:
        model.tie_weights()
    return model


def load_exact(bridge, model, state: dict[str, torch.Tensor]) -> None:
    """Load an export into an HF model, refusing a missing or unexpected weight (a missing key would keep stale
    weights without a word); a tied model's lm_head is its embedding, so the export leaves it out."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and bridge.hf_config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"export does not match the HF model: missing {missing}, unexpected {unexpected}")
