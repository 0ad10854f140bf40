"""Test-side name for ``megaopd.models.megatron.cpu_rehearsal`` (megatron-core on CPU under gloo; see that module)."""

from megaopd.models.megatron.cpu_rehearsal import redirect_cuda_to_cpu

__all__ = ["redirect_cuda_to_cpu"]
