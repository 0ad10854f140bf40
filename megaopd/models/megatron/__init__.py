"""The megatron-core backend (model.backend=megatron): TP/PP/DP students and teachers, HF <-> Megatron through
mbridge, FP8 through Transformer Engine. Imported only when that backend is chosen; see docs/megatron.md.
"""

from __future__ import annotations

import importlib.util

INSTALL = "pip install 'megaopd[megatron]' (megatron-core==0.16.1, mbridge==0.15.1, einops)"


def require() -> None:
    """Fail early, naming the packages, when the megatron extra is not installed."""
    missing = [name for name in ("megatron", "mbridge", "einops") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"model.backend=megatron needs {', '.join(missing)} (not installed): {INSTALL}")
