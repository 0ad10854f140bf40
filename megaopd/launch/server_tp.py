"""The tensor-parallel size of an SGLang server: the node's GPUs (or the launch setting ``sglang_tp``), refused
when the model's attention heads or KV heads do not split over it.

    python3 megaopd/launch/server_tp.py MODEL_DIR GPUS_PER_NODE [SGLANG_TP]   # prints the size, or says why not

Standard library only (with ``megaopd.accounting.flops``, the one reader of a model's heads, which is too):
slurm/stage_multinode.sbatch runs it in the batch shell (outside any container or venv), because a stage's model is
often written by an earlier job; ``megaopd submit`` checks the models that already exist when it renders the scripts.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script by the batch shell: import megaopd from the checkout it is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megaopd.accounting.flops import HF_CONFIG, attention_heads, read_hf_config  # noqa: E402


def server_tp(model_dir: str | Path, gpus: int, requested: int = 0) -> int:
    tp = requested or gpus
    if not 1 <= tp <= gpus:
        raise ValueError(f"sglang_tp={tp}: a server runs on one node, which has {gpus} GPU(s)")
    path = Path(model_dir) / HF_CONFIG
    try:
        config = read_hf_config(model_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the model's config ({e})") from None
    heads, kv_heads = attention_heads(config)
    if not heads:
        raise ValueError(f"{path}: no num_attention_heads; set the launch setting sglang_tp to the size to use")
    if fits(tp, heads, kv_heads):
        return tp
    sizes = [t for t in range(1, gpus + 1) if fits(t, heads, kv_heads)]
    raise ValueError(f"{path}: {heads} attention heads and {kv_heads} KV heads do not split over tensor-parallel "
                     f"size {tp} ({'sglang_tp' if requested else f'the node has {gpus} GPUs'}); sizes that do, "
                     f"up to {gpus}: {sizes}. Set the launch setting sglang_tp (or gpus_per_node) to one of them")


def fits(tp: int, heads: int, kv_heads: int) -> bool:
    """Query heads split evenly; KV heads split evenly, or are replicated over a multiple of their count."""
    return heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        print(server_tp(argv[0], int(argv[1]), int(argv[2]) if len(argv) == 3 else 0))
    except ValueError as e:
        print(f"megaopd: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
