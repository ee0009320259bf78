"""Schemas of the engine's own tensor ops (``torch.ops.dmtd.*``); their CPU kernels live in ``kernels/``.

Defined at import so the TorchScript decode loop can call them; a kernel is registered only when
:func:`dmtd.engine.lowbit.load_kernels` has built and loaded it.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("dmtd", "DEF")
# y[..., N] = x[..., K] · Wᵀ for a packed weight W (mode 1 bf16, 2 int8 per-group, 3 int4 per-group).
_LIB.define("linear(Tensor x, Tensor w, Tensor s, int mode) -> Tensor")
