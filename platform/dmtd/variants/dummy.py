"""``--load-format dummy`` (vLLM's spelling): a model's real architecture from its ``config.json`` alone, with seeded
random weights built straight in the precision it runs in.

Each tensor is drawn from its own generator, seeded by the seed and the tensor's name, in float32 and then cast: the
weights are the same for any layer count before them, any device, and a bfloat16 model holds the float32 one's
values rounded. The scale keeps every activation O(1) (no NaN, no overflow in bfloat16): projections ``N(0, 1 /
fan_in)`` (unit-variance outputs from unit-RMS inputs, as every layer's input is RMS-normalised), norms 1, biases
0, the embedding ``N(0, 1 / hidden)`` so that a tied lm_head gives logits of about unit spread, as an untied one does.
(vLLM's dummy weights are uniform in ±1e-3: logits then all but equal, which our checks of tokens would not tell
apart from noise.)
"""

from __future__ import annotations

import math
import zlib

import torch

from dmtd.engine.config import ModelConfig
from dmtd.engine.model import Transformer
from dmtd.engine.rope import rope_tables
from dmtd.variants.memory import check_fits, model_bytes


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: stable across processes and Python versions (no ``hash``)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def dummy_value(name: str, shape: tuple[int, ...], hidden_size: int, seed: int) -> torch.Tensor:
    """The float32 values of tensor ``name`` (engine layout: projections input-major ``[in, out]``)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    fan_in = hidden_size if name.startswith("embed_tokens") else shape[0]
    g = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.randn(shape, generator=g).mul_(1.0 / math.sqrt(fan_in))


def dummy_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                rope_len: int | None = None) -> Transformer:
    """A :class:`Transformer` of ``cfg`` with seeded random weights, allocated once in ``dtype`` on ``device``
    (never a float32 copy of the whole model first); refused before any allocation if it does not fit
    (:func:`dmtd.variants.memory.check_fits`)."""
    check_fits("the model's weights", model_bytes(cfg, dtype), device)
    length = rope_len or cfg.max_position_embeddings
    with torch.device("meta"):
        net = Transformer(cfg, rope_len=length)
    net = net.to(dtype=dtype).to_empty(device=device)
    cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, length)
    net.rope_cos, net.rope_sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(dummy_value(name, tuple(p.shape), cfg.hidden_size, seed))
    net.lm_head_t, net._weights = None, None
    return net.eval().requires_grad_(False)
