"""Build an engine for a base model or a variant (the one place the CLI, trainer and servers do it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from dmtd.engine.config import ConfigError, DMTDConfig, EngineConfig
from dmtd.engine.llm import LLMEngine
from dmtd.engine.model import LayerWeights
from dmtd.engine.phrase_table import PHRASE_TABLE_FORMAT, N, PhraseTable
from dmtd.engine.verifier import Verifier, own_verifier, snapshot_decoding_layers
from dmtd.variants.loader import LoadedModel, load_model
from dmtd.variants.manifest import (
    MANIFEST_NAME,
    ManifestError,
    VariantManifest,
    base_fingerprint,
    read_manifest,
    sha256_file,
)
from dmtd_contract.variant_schema import LORA_A_SUFFIX, verifier_of

BASE_TAU_MAX = 8
LORA_FORMAT = "dmtd-lora-v1"
LORA_A, LORA_B = LORA_A_SUFFIX, ".lora_B"


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """An input-major weight ``[in, out]`` plus its low-rank update ``scale · A[in, r] @ B[r, out]``.

    The one formula shared by training (differentiably, every step) and loading (once), so a trained
    adapter serves exactly what it was trained as.
    """
    return weight + torch.matmul(a, b) * scale


@dataclass(slots=True)
class EngineSpec:
    """What to run: a model, its routing and the default cycle settings."""

    loaded: LoadedModel
    dmtd: DMTDConfig
    default_tau: int
    min_confidence: float
    variant: VariantManifest | None
    verifier: Verifier | None = None  # None: the model verifies itself
    draft_vocab: list[int] | None = None
    phrase_table: PhraseTable | None = None

    @property
    def draft_threshold(self) -> float:
        """The exact profile's default draft stop (the manifest's ``draft_threshold``, else ``min_confidence``)."""
        return self.min_confidence if self.variant is None else self.variant.exact_draft_threshold()


def find_variant(name_or_path: str, search_dirs: list[Path] | None = None) -> Path:
    """A manifest path from a path or a variant name (looked up under the shipped variants dir)."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    for d in search_dirs or []:
        cand = d / name_or_path / MANIFEST_NAME
        if cand.is_file():
            return cand
    raise ManifestError(f"variant {name_or_path!r} not found (not a path, not a shipped variant)")


def checked_file(manifest: VariantManifest, root: Path, rel: str, sha: str | None, what: str) -> Path:
    path = root / rel
    if not path.is_file():
        raise ManifestError(f"variant {manifest.name!r}: {what} file {str(path)!r} not found")
    digest = sha256_file(path)
    if digest != sha:
        raise ManifestError(f"variant {manifest.name!r}: {what} checksum mismatch "
                            f"(manifest {sha}, file {digest}): the file is corrupted or was replaced")
    return path


def check_fits_base(loaded: LoadedModel, manifest: VariantManifest) -> None:
    """The manifest's layer split, vocabulary and base checksum match the loaded base model."""
    try:
        manifest.dmtd_config().check_model(loaded.config)
    except ConfigError as e:
        raise ManifestError(f"variant {manifest.name!r} does not fit base model {loaded.path}: {e}") from e
    if manifest.vocab_size is not None and manifest.vocab_size != loaded.config.vocab_size:
        raise ManifestError(f"variant {manifest.name!r} does not fit base model {loaded.path}: vocab_size "
                            f"{manifest.vocab_size} in the manifest, {loaded.config.vocab_size} in the model")
    if manifest.base_fingerprint is not None:
        have = base_fingerprint(loaded.path)
        if have != manifest.base_fingerprint:
            raise ManifestError(f"variant {manifest.name!r} does not fit base model {loaded.path}: base checksum "
                                f"{have[:16]}… differs from the manifest's {manifest.base_fingerprint[:16]}…")


def apply_variant_weights(loaded: LoadedModel, manifest: VariantManifest, root: Path) -> set[str]:
    """Check the manifest fits the base model, then load its tensors and merge its adapter over it.

    Returns the names of the base tensors the variant changed.
    """
    check_fits_base(loaded, manifest)
    changed: set[str] = set()
    if manifest.weights is not None:
        wpath = checked_file(manifest, root, manifest.weights, manifest.weights_sha256, "weights")
        tensors = load_file(str(wpath))
        _load_tensors(loaded, manifest, tensors)
        changed |= set(tensors)
    if manifest.adapter is not None:
        apath = checked_file(manifest, root, manifest.adapter, manifest.adapter_sha256, "adapter")
        changed |= apply_adapter(loaded, manifest, apath)
    loaded.model.lm_head_t, loaded.model._weights = None, None
    return changed


def read_draft_vocab(manifest: VariantManifest, root: Path) -> list[int] | None:
    """The variant's restricted tail vocabulary (token ids, most frequent first), checked against its hash."""
    if manifest.draft_vocab is None:
        return None
    path = checked_file(manifest, root, manifest.draft_vocab, manifest.draft_vocab_sha256, "draft_vocab")
    try:
        ids = load_file(str(path))["token_ids"]
    except (SafetensorError, OSError, KeyError) as e:
        raise ManifestError(f"variant {manifest.name!r}: draft_vocab {str(path)!r} holds no token_ids tensor") from e
    return [int(t) for t in ids.tolist()]


def read_phrase_table(manifest: VariantManifest, root: Path, vocab_size: int) -> PhraseTable | None:
    """The variant's phrase table (dmtd.engine.phrase_table), checked against its hash, its format and the base
    model's vocabulary (``vocab_size``): every context and next token an id of it, shares in percent, no context
    twice. A bad table fails the load, naming the tensor, before any request could draft from it."""
    if manifest.phrase_table is None:
        return None
    path = checked_file(manifest, root, manifest.phrase_table, manifest.phrase_table_sha256, "phrase_table")
    where = f"variant {manifest.name!r}: phrase_table {str(path)!r}"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            t = {k: f.get_tensor(k) for k in ("keys", "next", "share", "keys2", "next2", "share2")}
    except (SafetensorError, OSError, KeyError) as e:
        raise ManifestError(f"{where} is not a {PHRASE_TABLE_FORMAT} file ({e})") from e
    vocab = int(meta["vocab_size"]) if str(meta.get("vocab_size", "")).isdigit() else None
    if meta.get("format") != PHRASE_TABLE_FORMAT or vocab is None:
        raise ManifestError(f"{where} is not a {PHRASE_TABLE_FORMAT} file (its metadata's format and vocab_size)")
    if vocab != vocab_size:
        raise ManifestError(f"{where} was made for a vocabulary of {vocab}, the base model's is {vocab_size}")
    tables = []
    for suffix, n in (("", N), ("2", N - 1)):
        keys, nxt, share = t[f"keys{suffix}"], t[f"next{suffix}"], t[f"share{suffix}"]
        for name, x, dtype, high in ((f"keys{suffix}", keys, torch.int64, vocab ** n),
                                     (f"next{suffix}", nxt, torch.int32, vocab), (f"share{suffix}", share, torch.uint8,
                                                                                 101)):
            if x.dim() != 1 or x.dtype != dtype or len(x) != len(keys):
                raise ManifestError(f"{where}: {name} must be a 1-D {dtype} tensor as long as keys{suffix}")
            if len(x) and not (int(x.min()) >= 0 and int(x.max()) < high):
                raise ManifestError(f"{where}: {name} must hold values in 0..{high - 1}")
        if len(keys) != len(torch.unique(keys)):
            raise ManifestError(f"{where}: keys{suffix} must not hold a context twice")
        tables.append(dict(zip(keys.tolist(), zip(nxt.tolist(), share.tolist()))))
    return PhraseTable(vocab, tables[0], tables[1])


def read_adapter(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a LoRA adapter file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except (SafetensorError, OSError) as e:
        raise ManifestError(f"adapter {str(path)!r} is not a readable safetensors file: {e}") from e
    if meta.get("format") != LORA_FORMAT:
        raise ManifestError(f"adapter {str(path)!r} is not a {LORA_FORMAT} file (format={meta.get('format')!r})")
    return tensors, meta


def apply_adapter(loaded: LoadedModel, manifest: VariantManifest, path: Path) -> set[str]:
    """Merge ``W + (alpha / rank) · A @ B`` into the named weights, after checking the adapter's base."""
    tensors, meta = read_adapter(path)
    made_for = meta.get("base_fingerprint")
    have = manifest.base_fingerprint or base_fingerprint(loaded.path)
    if made_for != have:
        raise ManifestError(f"adapter {str(path)!r} was made for another base model (base checksum "
                            f"{str(made_for)[:16]}…, this base is {have[:16]}…)")
    try:
        scale = float(meta["alpha"]) / float(meta["rank"])
    except (KeyError, ValueError) as e:
        raise ManifestError(f"adapter {str(path)!r}: metadata lacks a numeric alpha and rank") from e
    own = loaded.model.state_dict()
    names = sorted(k[: -len(LORA_A)] for k in tensors if k.endswith(LORA_A))
    for name in names:
        a, b = tensors[name + LORA_A], tensors.get(name + LORA_B)
        if name not in own or b is None:
            raise ManifestError(f"adapter {str(path)!r}: {name!r} is not a base weight or lacks its B matrix")
        if a.shape[0] != own[name].shape[0] or b.shape[1] != own[name].shape[1] or a.shape[1] != b.shape[0]:
            raise ManifestError(f"adapter {str(path)!r}: {name!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                                f"which do not fit the base weight {tuple(own[name].shape)}")
    with torch.no_grad():
        for name in names:
            w = own[name]
            a, b = (tensors[name + k].to(device=w.device, dtype=w.dtype) for k in (LORA_A, LORA_B))
            w.copy_(merge_lora(w, a, b, scale))  # the model may live on a GPU (training there)
    return set(names)


def _load_tensors(loaded: LoadedModel, manifest: VariantManifest, tensors: dict[str, torch.Tensor]) -> None:
    own = loaded.model.state_dict()
    for k, t in tensors.items():
        if k not in own:
            raise ManifestError(f"variant {manifest.name!r}: tensor {k!r} does not exist in the base model")
        if tuple(t.shape) != tuple(own[k].shape):
            raise ManifestError(f"variant {manifest.name!r}: tensor {k!r} has shape {tuple(t.shape)}, "
                                f"the base model's is {tuple(own[k].shape)}")
    with torch.no_grad():
        for k, t in tensors.items():
            own[k].copy_(t.to(own[k].dtype))


def variant_verifier(dmtd: DMTDConfig, changed: set[str], base_layers: list[LayerWeights] | None) -> Verifier:
    """The verifying path of a variant whose files changed the base tensors ``changed`` (``verifier_of``'s rule);
    ``base_layers``: the base model's decoding-group weights, copied before the variant's were merged."""
    name = verifier_of(changed, dmtd.decoding_start, dmtd.num_layers, dmtd.head_input)
    if name == "base" and changed:
        assert base_layers is not None, "a variant that changes base tensors needs the base copies to verify"
        return Verifier("base", "replace", base_layers)
    return own_verifier(dmtd, is_base=not changed)


def engine_spec(model: str | None = None, variant: str | None = None, decoding_layers: int | None = None,
                dtype: torch.dtype = torch.float32, device: str = "cpu",
                search_dirs: list[Path] | None = None, load_format: str = "auto") -> EngineSpec:
    """Resolve ``--model`` / ``--variant`` / ``--decoding-layers`` / ``--load-format`` into a loaded model and routing.

    The model is loaded and the variant merged in float32, then cast to ``dtype`` (verifier copies too); a plain
    model's dummy weights (``load_format="dummy"``) are built in ``dtype`` directly, the bfloat16 ones the float32
    ones rounded, without a float32 copy of the model in memory.
    """
    plain_dummy = load_format == "dummy" and variant in (None, "none")
    spec = _engine_spec(model, variant, decoding_layers, device, search_dirs, load_format,
                        dtype if plain_dummy else torch.float32)
    if dtype != torch.float32:
        spec.loaded.model.to(dtype)
        if spec.verifier is not None and spec.verifier.layers is not None:
            spec.verifier.layers = [LayerWeights._make(None if t is None else t.to(dtype) for t in w)
                                    for w in spec.verifier.layers]
    return spec


def _engine_spec(model: str | None, variant: str | None, decoding_layers: int | None, device: str,
                 search_dirs: list[Path] | None, load_format: str, dtype: torch.dtype) -> EngineSpec:
    if variant not in (None, "none"):
        mpath = find_variant(variant, search_dirs)
        manifest = read_manifest(mpath)
        root = mpath if mpath.is_dir() else mpath.parent
        loaded = load_model(model or manifest.base_model, dtype=dtype, device=device, load_format=load_format)
        dmtd = manifest.dmtd_config()
        fits = dmtd.num_layers == loaded.config.num_layers  # else apply_variant_weights names the mismatch
        base_layers = snapshot_decoding_layers(loaded.model, dmtd) if fits else None
        changed = apply_variant_weights(loaded, manifest, root)
        verifier = variant_verifier(dmtd, changed, base_layers)
        if manifest.verifier is not None and manifest.verifier != verifier.name:
            raise ManifestError(f"variant {manifest.name!r}: verifier is {manifest.verifier!r} in the manifest, but "
                                f"its tensors make it {verifier.name!r} (base: changes only in the decoding group)")
        return EngineSpec(loaded, dmtd, manifest.default_tau, manifest.min_confidence, manifest, verifier,
                          read_draft_vocab(manifest, root),
                          read_phrase_table(manifest, root, loaded.config.vocab_size))
    loaded = load_model(model, dtype=dtype, device=device, load_format=load_format)
    if loaded.dmtd is not None and decoding_layers is None:  # a DMTD checkpoint verifies with its τ = 1 path
        return EngineSpec(loaded, loaded.dmtd, loaded.dmtd.tau_max, 0.0, None, own_verifier(loaded.dmtd, False))
    L = loaded.config.num_layers
    dmtd = DMTDConfig.plain(L, decoding_layers or 1, BASE_TAU_MAX if decoding_layers else 1)
    return EngineSpec(loaded, dmtd, 1, 0.0, None, own_verifier(dmtd, True))


def build_engine(spec: EngineSpec, cfg: EngineConfig | None = None) -> LLMEngine:
    """The engine of ``spec``; a KV pool (with the engine's packed copy of the weights) that does not fit the memory
    left is refused first, with the figures."""
    from dmtd.variants.memory import check_fits, kv_pool_bytes, packed_bytes

    cfg = cfg or EngineConfig()
    check_fits("the KV pool and the engine's packed weights", kv_pool_bytes(spec.loaded.config, spec.dmtd, cfg)
               + packed_bytes(spec.loaded.config, cfg), cfg.device)
    serve_packed(spec, cfg)
    return LLMEngine(spec.loaded.model, spec.loaded.tokenizer, spec.dmtd, cfg, default_tau=spec.default_tau,
                     verifier=spec.verifier, draft_vocab=spec.draft_vocab,
                     phrase_table=spec.phrase_table)


def serve_packed(spec: EngineSpec, cfg: EngineConfig) -> None:
    """Where the engine multiplies by the bf16 kernels (a bfloat16 model on the CPU), pack the model's projections and
    a base verifier's decoding group in place and free their dense copies, so the replica holds its weights once:
    the engine's runner then takes the packed ones as they are. Lossless (the packed values are the bf16 ones; the
    drafts' int8 copy is packed from them as from the dense), and skipped wherever the runner would not pack."""
    from dmtd.engine import lowbit

    model = spec.loaded.model
    if (next(model.parameters()).dtype != torch.bfloat16 or cfg.dtype != "bfloat16"
            or lowbit.weight_format(cfg.dtype, cfg.quant, torch.device(cfg.device).type) != "bf16"
            or not lowbit.fits(model.layer_weights(), "bf16")):
        return
    model.pack_projections(lambda w: lowbit.pack(w, "bf16"))
    if spec.verifier is not None and spec.verifier.layers is not None:
        spec.verifier.layers = lowbit.pack_layers(spec.verifier.layers, "bf16")


def variant_precision(variant: str | None, dtype: str | None, quant: str | None, device: str,
                      search_dirs: list[Path] | None = None) -> tuple[str, str]:
    """dtype and quantisation to run: as given, else the variant manifest's recommendation, else auto / none.

    ``auto`` is bfloat16 on a CPU whose kernels build with vector code (:func:`dmtd.engine.lowbit.resolve_dtype`),
    for every profile: the kernels are row-invariant on each path, so verified cycles give the verifier's tokens
    bit for bit at any batch in bfloat16 as in float32.
    """
    from dmtd.engine.lowbit import resolve_dtype
    from dmtd.variants.paths import SHIPPED_VARIANTS

    manifest = None
    if variant not in (None, "none") and (dtype is None or quant is None):
        manifest = read_manifest(find_variant(variant, search_dirs or [SHIPPED_VARIANTS]))
    dtype = dtype or (manifest.dtype if manifest is not None else "auto")
    quant = quant or (manifest.quant if manifest is not None else "none")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
    return resolve_dtype(dtype, device), quant
