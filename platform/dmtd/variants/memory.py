"""Memory guards: a model or KV pool that does not fit is refused before it is allocated, with the figures (needed
against available), not killed by the kernel's OOM mid-load or mid-request."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig, ModelConfig
from dmtd.engine.kv_cache import bytes_per_position
from dmtd.engine.kv_pages import pages_for
from dmtd.engine.model import Transformer

GIB = 2**30
# what else a process needs beside the guarded tensors (activations, the kernels' packed copies' staging, Python)
HEADROOM_BYTES = GIB // 2


def param_count(cfg: ModelConfig) -> int:
    """Parameters of a model of ``cfg`` (tied embeddings once), counted on the meta device: nothing allocated."""
    with torch.device("meta"):
        net = Transformer(cfg, rope_len=2)
    return sum(p.numel() for p in net.parameters())


def model_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return param_count(cfg) * torch.empty(0, dtype=dtype).element_size()


def kv_pool_bytes(cfg: ModelConfig, dmtd: DMTDConfig, ecfg: EngineConfig) -> int:
    """The KV pool an engine of ``ecfg`` allocates (sized as ``dmtd.engine.runner``'s ``_page_pool``), with the
    verifier's decoding group counted: the exact profile allocates it on first use."""
    if ecfg.kv_cache_gib is not None:
        return int(ecfg.kv_cache_gib * GIB)
    dtype = getattr(torch, ecfg.dtype)
    # the runner's rule (kv_dtype_for): bfloat16 models keep float32 KV unless kv_cache_dtype is bfloat16
    kv_dtype = (torch.bfloat16 if ecfg.kv_cache_dtype == "bfloat16" else
                torch.float32 if dtype == torch.bfloat16 else dtype)
    P = math.gcd(ecfg.page_size, ecfg.prefill_chunk) if ecfg.prefix_caching else ecfg.page_size
    positions = ecfg.kv_cache_tokens or ecfg.max_num_seqs * pages_for(ecfg.max_model_len, P) * P
    hidden = torch.float32 if dtype == torch.bfloat16 else dtype  # stashes: float32 activations beside bf16 weights
    return positions * bytes_per_position(cfg, dmtd, kv_dtype, hidden)


# bytes a parameter takes in the engine's packed copy of the weights (dmtd.engine.lowbit's formats; int formats
# with their per-group scales, rounded up)
PACKED_BYTES = {"bf16": 2.0, "int8": 1.125, "int4": 0.75}


def packed_bytes(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """What the engine's packed weights add to the model's: none for torch's dense matmuls (float32, or no kernels
    here); in bf16 the lm_head's packed copy only (the layers' projections are packed in place, their dense copies
    freed: dmtd.variants.build.serve_packed); in int8 or int4 a copy of the layers and lm_head beside the model's."""
    from dmtd.engine import lowbit

    fmt = lowbit.weight_format(ecfg.dtype, ecfg.quant, torch.device(ecfg.device).type)
    if fmt is None:
        return 0
    if fmt == "bf16":
        return int(cfg.vocab_size * cfg.hidden_size * PACKED_BYTES[fmt])
    return int((param_count(cfg) - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1))
               * PACKED_BYTES.get(fmt, 2.0))


def available_bytes(device: str = "cpu") -> int:
    """Memory this process may still take on ``device``: the GPU's free memory, or the host's available memory
    within the cgroup's limit."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    free = _meminfo_available()
    limit = _cgroup_left()
    return free if limit is None else min(free, limit)


def check_fits(what: str, needed: int, device: str = "cpu") -> None:
    """Raise :class:`ConfigError` naming ``what`` with the figures if ``needed`` bytes (plus a headroom) exceed what
    ``device`` has available now."""
    have = available_bytes(device)
    if needed + HEADROOM_BYTES > have:
        raise ConfigError(f"{what} need {needed / GIB:.2f} GiB (+{HEADROOM_BYTES / GIB:.1f} GiB headroom), "
                          f"{have / GIB:.2f} GiB available on {device}: a smaller model, dtype or KV pool "
                          "(--max-num-seqs, --max-model-len, --kv-cache-tokens) fits")


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: nothing is refused


def _cgroup_left() -> int | None:
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            return int(raw) - int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
    return None
