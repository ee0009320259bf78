"""bf16 and low-bit (int8, int4) weight-only linear layers, applied to a built model (gpt-fast style).

Decoding on a CPU reads every weight once per step, so its speed is the bytes per weight. The model
code knows nothing of this: :func:`pack_model` gives the engine packed copies of the projection weights
and the lm_head, and :func:`dmtd.engine.model.project` multiplies by whichever it is handed.

Formats (weights stored output-major, ``[N, K]``, in groups of 32 along K):

* ``bf16`` — the weights rounded to bfloat16 (2 bytes each);
* ``int8`` — a float scale per group of 32, ``w ≈ d·q`` with ``q`` in −127..127 (1.125 bytes each);
* ``int4`` — a scale and a minimum per group, ``w ≈ d·q + m`` with ``q`` in 0..15 (0.75 bytes each,
  the layout of GGUF's Q4_1);
* ``i8dot`` — int8 with one scale per output row, multiplied by activations that the kernel quantises to
  int8 per block of 64 inputs (integer dot products: AVX512-VNNI, else AVX2; ~1 byte each). Coarser than ``int8``: the
  exact profile's drafts use it (:func:`draft_format`), whose tokens the base model checks anyway.

The kernels (``kernels/lowbit.cpp``, registered as ``torch.ops.dmtd.linear``) are compiled once for
the CPU that runs them with the C++ compiler torch's extension builder finds, and cached under
``$DMTD_CACHE/kernels``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

import dmtd.engine.ops  # noqa: F401 — defines the dmtd::linear schema
from dmtd.engine.config import ConfigError
from dmtd.engine.ops import cpu_paths, kernel_path, simd_kernels

Quant = Literal["none", "int8", "int4"]
QUANTS: tuple[str, ...] = ("none", "int8", "int4")
MODES = {"bf16": 1, "int8": 2, "int4": 3, "i8dot": 4}
BF16_BLOCKED = 5  # the bf16 format's mode when its weights are blocked (PackedWeight.blocked)
GROUP = 32
DOT_BLOCK = 64  # i8dot: activations are quantised per block of this many inputs
SOURCE = Path(__file__).parent / "kernels" / "lowbit.cpp"

_lock = threading.Lock()
_loaded: bool | None = None
_load_error = ""


class KernelUnavailable(ConfigError):
    """The low-bit kernels cannot be built or run on this machine."""


# the compiler's flags per path: -march=native with the instructions of the faster paths turned off, so that a
# developer on any machine builds and tests every path the CPU has (DMTD_KERNEL_PATH)
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
PATH_FLAGS: dict[str, list[str]] = {
    "amx": ["-march=native"],
    "avx512bf16": ["-march=native", *_NO_AMX],
    "avx512": ["-march=native", "-mno-avx512bf16", *_NO_AMX],
    "avx2": ["-march=native", "-mno-avx512f", *_NO_AMX],
    "portable": ["-march=x86-64"] if os.uname().machine == "x86_64" else ["-march=native"],
}
PATH_CODES = {"amx": 3, "avx512bf16": 4, "avx512": 2, "avx2": 1, "portable": 0}


def _build_dir(path: str) -> Path:
    """One build directory per kernel source, path, CPU, torch version and torch installation: the compile command
    names the installation's include paths, so two virtual environments sharing one directory would each
    see the other's build as stale and recompile it (30-40 s, under a file lock) at every start."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        pass
    sources = b"".join(f.read_bytes() for f in sorted(SOURCE.parent.iterdir()) if f.suffix in (".cpp", ".h"))
    key = hashlib.sha256(sources + torch.__version__.encode() + flags.encode() + " ".join(PATH_FLAGS[path]).encode()
                         + str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:16]
    root = Path(os.environ.get("DMTD_CACHE", Path.home() / ".cache" / "dmtd"))
    return root / "kernels" / f"lowbit-{path}-{key}"


def load_kernels() -> None:
    """Build (once per CPU and torch version) and load the kernels; :class:`KernelUnavailable` if impossible."""
    global _loaded, _load_error
    with _lock:
        if _loaded is None and os.environ.get("DMTD_LOWBIT_KERNELS") == "0":
            _loaded, _load_error = False, "turned off by DMTD_LOWBIT_KERNELS=0"
        if _loaded is None:
            try:
                from torch.utils import cpp_extension

                path = kernel_path()
                if path not in cpu_paths():
                    raise KernelUnavailable(f"DMTD_KERNEL_PATH={path}: this CPU runs only {', '.join(cpu_paths())}")
                build = _build_dir(path)
                build.mkdir(parents=True, exist_ok=True)
                if not any(build.glob("*.so")):
                    print(f"compiling the low-bit kernels for this CPU (once; {build}) ...", file=sys.stderr)
                # torch's builder guards the folder with a lock file that a killed build leaves behind, and every
                # later process then waits on it forever; an OS lock (dropped when its process dies) guards it
                # instead, and whoever holds it clears a stale file of torch's
                with open(build / "build.flock", "w") as guard:
                    fcntl.flock(guard, fcntl.LOCK_EX)
                    (build / "lock").unlink(missing_ok=True)
                    cpp_extension.load(name="dmtd_lowbit", sources=[str(SOURCE)], build_directory=str(build),
                                       extra_cflags=["-O3", *PATH_FLAGS[path], "-fopenmp"],
                                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
                built = int(torch.ops.dmtd.kernel_path(torch.empty(0)))
                if built != PATH_CODES[path]:
                    raise KernelUnavailable(f"the {path} build reports path code {built} (-1: AMX refused)")
                _loaded = True
            except Exception as e:  # noqa: BLE001 — no compiler, no ninja, a build error: all mean "not here"
                _loaded, _load_error = False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        if not _loaded:
            raise KernelUnavailable(f"the low-bit kernels cannot be built on this machine ({_load_error})")


def loaded_path() -> str | None:
    """The kernel path loaded in this process (None: none loaded)."""
    if not _loaded:
        return None
    code = int(torch.ops.dmtd.kernel_path(torch.empty(0)))
    return next(p for p, c in PATH_CODES.items() if c == code)


def kernels_loaded() -> bool:
    """Whether the kernels are built and loaded in this process (never builds them)."""
    return bool(_loaded)


def kernels_available() -> bool:
    try:
        load_kernels()
    except KernelUnavailable:
        return False
    return True


@dataclass(slots=True)
class PackedWeight:
    """A projection's weight in a packed format; ``project(x)`` is ``x @ W`` for the dense ``W [K, N]``."""

    fmt: str  # "bf16" | "int8" | "int4" | "i8dot"
    data: torch.Tensor  # [N, K] bf16/int8, or [N, K/2] uint8 (two 4-bit weights per byte); blocked bf16: see below
    scales: torch.Tensor  # [N, K/32] (int8), [N, K/32, 2] scale and minimum (int4), [N] (i8dot), empty (bf16)
    in_features: int
    out_features: int
    # bf16 on the avx512bf16 path: data [ceil(N/16), K/2, 32], blocks of 16 outputs with their input pairs side by
    # side (kernels/bf16dot.h), scales an empty [N, 0] that carries N to the kernel
    blocked: bool = False

    @property
    def mode(self) -> int:
        return BF16_BLOCKED if self.blocked else MODES[self.fmt]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if not _loaded:
            load_kernels()
        return torch.ops.dmtd.linear(x, self.data, self.scales, self.mode)

    def rows(self, ids: torch.Tensor) -> PackedWeight:
        """The output rows ``ids`` (a restricted lm_head)."""
        if self.blocked:
            return pack(unpack(self)[ids], "bf16")  # exact: the values are bf16 already
        return PackedWeight(self.fmt, self.data[ids].contiguous(), self.scales[ids].contiguous()
                            if self.scales.numel() else self.scales, self.in_features, len(ids))

    def dense(self) -> torch.Tensor:
        """The weight as the format stores it, dequantised to float32 ``[K, N]`` (tests, quality reports)."""
        return unpack(self).t()

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's input-major shape ``[K, N]`` (as the model's projections hold it)."""
        return self.in_features, self.out_features

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def pack(w_out_major: torch.Tensor, fmt: str) -> PackedWeight:
    """Quantise a dense weight ``[N, K]`` (output-major, as F.linear holds it) into ``fmt``."""
    if fmt not in MODES:
        raise ConfigError(f"weight format must be one of {sorted(MODES)}, got {fmt!r}")
    w = w_out_major.detach().float().contiguous()
    N, K = w.shape
    block = input_block(fmt)
    if K % block:
        raise ConfigError(f"{fmt} weights need an input size that is a multiple of {block}, got {K}")
    if fmt == "bf16":
        if blocked_bf16():
            return PackedWeight(fmt, _block_pairs(w.to(torch.bfloat16)), torch.empty(N, 0), K, N, blocked=True)
        return PackedWeight(fmt, w.to(torch.bfloat16).contiguous(), torch.empty(0), K, N)
    if fmt == "i8dot":
        d = w.abs().amax(-1) / 127.0
        q = torch.round(w / d.clamp(min=1e-30).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return PackedWeight(fmt, q.contiguous(), d.contiguous(), K, N)
    g = w.view(N, K // GROUP, GROUP)
    if fmt == "int8":
        d = g.abs().amax(-1) / 127.0
        q = torch.round(g / d.clamp(min=1e-30).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return PackedWeight(fmt, q.view(N, K).contiguous(), d.contiguous(), K, N)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15.0
    q = torch.round((g - lo.unsqueeze(-1)) / d.clamp(min=1e-30).unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    half = GROUP // 2
    packed = q[..., :half] | (q[..., half:] << 4)  # byte j: weight j (low nibble), weight j + 16 (high)
    return PackedWeight(fmt, packed.reshape(N, K // 2).contiguous(), torch.stack((d, lo), -1).contiguous(), K, N)


def blocked_bf16() -> bool:
    """Whether bf16 weights are packed blocked here: on the ``avx512bf16`` path (kernels/bf16dot.h)."""
    try:
        return kernel_path() == "avx512bf16"
    except ValueError:
        return False


def _block_pairs(w: torch.Tensor) -> torch.Tensor:
    """bf16 ``[N, K]`` → ``[ceil(N/16), K/2, 32]``: ``out[b, p, 2l + e] = w[16b + l, 2p + e]`` (rows past N zero)."""
    N, K = w.shape
    nb = -(-N // 16)
    padded = torch.zeros(nb * 16, K, dtype=w.dtype)
    padded[:N] = w
    return padded.view(nb, 16, K // 2, 2).permute(0, 2, 1, 3).reshape(nb, K // 2, 32).contiguous()


def unpack(p: PackedWeight) -> torch.Tensor:
    """The dense ``[N, K]`` float32 weight a packed one stands for."""
    N, K = p.out_features, p.in_features
    if p.blocked:
        nb = p.data.shape[0]
        return p.data.view(nb, K // 2, 16, 2).permute(0, 2, 1, 3).reshape(nb * 16, K)[:N].float()
    if p.fmt == "bf16":
        return p.data.float()
    if p.fmt == "i8dot":
        return p.data.float() * p.scales.unsqueeze(-1)
    if p.fmt == "int8":
        return (p.data.view(N, K // GROUP, GROUP).float() * p.scales.unsqueeze(-1)).view(N, K)
    b = p.data.view(N, K // GROUP, GROUP // 2)
    q = torch.cat((b & 0xF, b >> 4), -1).float()
    return (q * p.scales[..., :1] + p.scales[..., 1:]).view(N, K)


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on a CPU with AVX-512 or AVX2 + FMA where the kernels build (measured ~2x fp32 at batch
    1 with AVX-512, `dmtd bench engine`), else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cpu" and simd_kernels() and kernels_available() else "float32"


def weight_format(dtype: str, quant: str, device: str = "cpu") -> str | None:
    """The packed format an engine with this dtype and quantisation uses (None: torch's own dense matmuls).

    Raises :class:`KernelUnavailable` (a ConfigError) when ``quant`` asks for kernels this machine cannot run.
    """
    if quant not in QUANTS:
        raise ConfigError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    if quant != "none":
        if device != "cpu":
            raise KernelUnavailable(f"quant {quant!r} runs on CPU only (device {device!r}); supported there: none")
        if dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"quant {quant!r} needs dtype float32 or bfloat16, got {dtype!r}")
        try:
            load_kernels()
        except KernelUnavailable as e:
            raise KernelUnavailable(f"quant {quant!r} cannot run here: {e}; supported on this machine: none") from e
        return quant
    return "bf16" if dtype == "bfloat16" and device == "cpu" and kernels_available() else None


def draft_format(draft_quant: str, device: str = "cpu") -> str | None:
    """The packed format of the exact profile's draft weights (None: the engine's own weights).

    ``auto`` is i8dot on a CPU with AVX512-VNNI or AVX2 where the kernels build (measured ~2x the bf16 kernel's
    weights/s at one row with VNNI, ~1.5-2x with AVX2); ``int8`` asks for it and raises :class:`KernelUnavailable`
    where it cannot run.
    """
    if draft_quant == "none" or device != "cpu":
        if draft_quant == "int8":
            raise KernelUnavailable(f"draft_quant 'int8' runs on CPU only (device {device!r})")
        return None
    if draft_quant == "auto":
        return "i8dot" if simd_kernels() and kernels_available() else None
    if draft_quant != "int8":
        raise ConfigError(f"draft_quant must be auto, none or int8, got {draft_quant!r}")
    load_kernels()
    return "i8dot"


def input_block(fmt: str) -> int:
    """What a packed weight's input size must be a multiple of."""
    return DOT_BLOCK if fmt == "i8dot" else GROUP


def fits(layers: list, fmt: str) -> bool:
    """Whether every projection's input size (the hidden size among them, the lm_head's too) is a multiple of
    ``fmt``'s block (input-major weights)."""
    block = input_block(fmt)
    return all(w.shape[0] % block == 0 for lw in layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down))


def pack_layers(layers: list, fmt: str) -> list:
    """Packed copies of LayerWeights: the four projections packed, norms and biases kept as they are."""
    out = []
    for w in layers:
        out.append(w._replace(qkv=_pack_in_major(w.qkv, fmt), o=_pack_in_major(w.o, fmt),
                              gate_up=_pack_in_major(w.gate_up, fmt), down=_pack_in_major(w.down, fmt)))
    return out


def _pack_in_major(w: torch.Tensor | PackedWeight, fmt: str) -> PackedWeight:
    if isinstance(w, PackedWeight):
        if w.fmt == fmt:
            return w
        if w.fmt == "bf16":  # the model serves bf16 packed weights: their values are the dense bf16 ones
            return pack(unpack(w), fmt)
        raise ConfigError(f"weights already packed as {w.fmt}, asked for {fmt}")
    return pack(w.t(), fmt)
