"""The cases every ``megaopd.models.policy_protocol.Policy`` must pass, measured against transformers' own forward.

``run_contract`` drives a built, trainable policy through the protocol and returns what it measured; the HF backend
runs it in-process and the Megatron backend (CPU, gloo) under torchrun, where rank 0 writes the numbers as JSON:

    torchrun --nproc-per-node 2 tests/policy_contract.py MODEL_DIR WORK_DIR TP

tests/test_policy_contract.py asserts the same bounds on both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TOPK = 8
MBS = 2  # micro-batches of 2 over 6 rows: accumulation must not change the token-mean loss


def contract_batch(seed: int = 1) -> "TokenBatch":
    """Six right-padded byte-token sequences of different lengths, responses after a 4-token prompt."""
    from megaopd.data.batch import TokenBatch

    g = torch.Generator().manual_seed(seed)
    lengths = [14, 9, 12, 7, 14, 10]
    ids = torch.full((len(lengths), max(lengths)), 256, dtype=torch.long)
    attention = torch.zeros_like(ids)
    response = torch.zeros((len(lengths), max(lengths) - 1))
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, 256, (n,), generator=g)
        attention[i, :n] = 1
        response[i, 3: n - 1] = 1
    return TokenBatch(ids, attention, response, torch.zeros_like(response))


def reference_logprobs(model_dir: str | Path, batch, temperature: float = 1.0) -> torch.Tensor:
    """transformers' float32 log-softmax at every target position, [B, S-1, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return (logits[:, :-1].float() / temperature).log_softmax(-1)


def realised(full: torch.Tensor, batch) -> torch.Tensor:
    return full.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * batch.response_mask


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def nll(logp, vocab_term, mb):
    """The simplest per-token loss: raise the logprob of every response token."""
    return -logp, {"logp": logp}


def run_contract(policy, model_dir: str | Path, work: Path) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from megaopd.models.policy_protocol import Policy
    from megaopd.accounting.flops import ModelShape

    batch = contract_batch()
    mask = batch.response_mask.bool()
    tokens = float(batch.response_mask.sum())
    full_ref = reference_logprobs(model_dir, batch)
    token_ref = realised(full_ref, batch)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    out = {"is_policy": isinstance(policy, Policy),
           "ids": [policy.pad_id, policy.eos_id, tokenizer.pad_token_id, tokenizer.eos_token_id],
           "shape_matches": policy.shape == ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))}

    logp = policy.logprobs(batch, MBS)
    out["logprobs"] = _diff(logp, token_ref)
    out["logprobs_off_response"] = float(logp[~mask].abs().max())
    logp_t2 = policy.logprobs(batch, MBS, temperature=2.0)
    out["logprobs_t2"] = _diff(logp_t2, realised(reference_logprobs(model_dir, batch, 2.0), batch))
    # the trainer's old logprobs and its sampling-distribution ones from one forward: each as on its own
    under = policy.logprobs_under(batch, MBS, [(1.0, 1.0), (2.0, 1.0)])
    out["logprobs_under"] = max(_diff(under[0], logp), _diff(under[1], logp_t2))
    full = policy.full_logprobs(batch, MBS)
    out["full_logprobs"] = _diff(full[mask], full_ref[mask])
    topk = policy.topk_logprobs(batch, TOPK, MBS)
    values, ids = full_ref[mask].topk(TOPK, dim=-1)
    out["topk"] = _diff(topk["topk"][mask], values)
    out["topk_ids_agree"] = float((topk["topk_ids"][mask] == ids).float().mean())
    out["topk_realised"] = _diff(topk["realised"], token_ref)
    out["topk_tail"] = _diff(topk["tail"][mask], full_ref[mask].scatter(-1, ids, -torch.inf).logsumexp(-1))

    out["loss_before"] = -float(token_ref.sum()) / tokens
    metrics = policy.train_minibatch(batch, nll, MBS)
    out["loss_reported"] = metrics["loss"]
    out["grad_norm"] = metrics["grad_norm"]
    trained = policy.logprobs(batch, MBS)
    out["loss_after"] = -float(trained.sum()) / tokens

    # The trainer's checkpoint: the state goes through torch.save; a further step is undone by loading it.
    torch.save(policy.state_dict(), work / "policy_state.pt")
    policy.train_minibatch(batch, nll, MBS)
    stepped = policy.logprobs(batch, MBS)
    out["second_step_moves"] = _diff(stepped, trained)
    policy.load_state_dict(torch.load(work / "policy_state.pt", weights_only=False))
    out["state_restored"] = _diff(policy.logprobs(batch, MBS), trained)
    policy.train_minibatch(batch, nll, MBS)  # the optimizer state came back too: the same step lands the same
    out["resumed_step"] = _diff(policy.logprobs(batch, MBS), stepped)
    policy.load_state_dict(torch.load(work / "policy_state.pt", weights_only=False))

    policy.save_hf(work / "hf")
    reloaded = reference_logprobs(work / "hf", batch)
    out["save_hf"] = _diff(realised(reloaded, batch), trained)
    names = dict(policy.hf_named_tensors())
    saved = {k: v for f in (work / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    out["named_tensors"] = max(_diff(names[k], v) for k, v in saved.items()) if set(saved) <= set(names) else -1.0
    return out


if __name__ == "__main__":  # the Megatron half, under torchrun
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # megatron_cpu, megaopd
    from megatron_cpu import redirect_cuda_to_cpu

    redirect_cuda_to_cpu()
    import torch.distributed as dist

    from megaopd.config import MegatronConfig, ModelConfig, OptimConfig
    from megaopd.models.megatron.policy import MegatronPolicy

    model_dir, work, tp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    cfg = ModelConfig(path=model_dir, backend="megatron", megatron=MegatronConfig(tp=tp))
    policy = MegatronPolicy(cfg, OptimConfig(), checkpoint_dir=work / "dist_checkpoints")
    result = run_contract(policy, model_dir, work)
    if dist.get_rank() == 0:
        (work / "contract.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
