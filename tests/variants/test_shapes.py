"""Shapes without weights: ``--load-format dummy`` on tiny shapes exported as the presets are, and the presets'
folders as transformers reads them (on the meta device: no large memory)."""

from __future__ import annotations

import json

import pytest
import torch

from dmtd.engine.config import ConfigError, EngineConfig, ModelConfig
from dmtd.engine.sequence import SamplingParams
from dmtd.variants.build import build_engine, engine_spec
from dmtd.variants.loader import load_model
from dmtd.variants.memory import param_count
from dmtd.variants.shapes import PLACEHOLDER, export_shape, preset, preset_names

SMOL_VOCAB = 49152  # the shipped tokenizer's own entries: a tiny shape needs no placeholders


def tiny_shape(kind: str, vocab_size: int = SMOL_VOCAB) -> dict:
    """A preset's architecture at a few layers and a small width."""
    cfg = dict(preset("qwen3-1.7b" if kind == "qwen3" else "llama-3.2-1b").config)
    cfg.update(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, max_position_embeddings=4096)
    if kind == "llama-untied":
        cfg["tie_word_embeddings"] = False
    return cfg


@pytest.fixture(scope="module")
def shape_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {kind: export_shape(tiny_shape(kind), root / kind) for kind in ("qwen3", "llama", "llama-untied")}


def test_dummy_weights_are_seeded_and_a_bfloat16_model_holds_the_float32_ones_rounded(shape_dirs):
    d = shape_dirs["qwen3"]
    a = load_model(d, load_format="dummy", tokenizer=False).model.state_dict()
    b = load_model(d, load_format="dummy", tokenizer=False).model.state_dict()
    c = load_model(d, load_format="dummy", tokenizer=False, seed=1).model.state_dict()
    h = load_model(d, load_format="dummy", tokenizer=False, dtype=torch.bfloat16).model.state_dict()
    assert a.keys() == b.keys() == h.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    w = "layers.2.mlp.gate_up_proj.weight"
    assert not torch.equal(a[w], c[w])
    assert all(h[k].dtype == torch.bfloat16 and torch.equal(h[k], a[k].to(torch.bfloat16)) for k in a)
    # the layers' weights are not copies of one another, and the scale is 1 / fan_in
    assert not torch.equal(a["layers.0.self_attn.o_proj.weight"], a["layers.1.self_attn.o_proj.weight"])
    assert a[w].std().item() == pytest.approx(64 ** -0.5, rel=0.05)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_and_logits_stay_finite_and_spread(shape_dirs, kind, dtype):
    net = load_model(shape_dirs[kind], load_format="dummy", tokenizer=False, dtype=dtype).model
    ids = torch.randint(0, SMOL_VOCAB, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lg = net.logits(net.run_layers(net.embed_tokens(ids), 0, 4, *net.rope(torch.arange(300).unsqueeze(0))))
    assert torch.isfinite(lg).all()
    spread = lg.float().std(dim=-1)
    assert spread.min().item() > 0.3 and spread.max().item() < 5.0  # neither all equal nor one-hot


@pytest.mark.parametrize("kind", ["qwen3", "llama", "llama-untied"])
def test_the_folder_is_the_same_model_in_transformers(shape_dirs, kind):
    """transformers builds the folder's config (from_config) with our parameter count, and with our dummy weights
    loaded its greedy generate writes the engine's τ = 1 tokens: the folder means one architecture to both."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = shape_dirs[kind]
    lm = load_model(d, load_format="dummy")
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(d)), dtype=torch.float32).eval()
    assert sum(p.numel() for p in hf.parameters()) == param_count(lm.config) == sum(
        p.numel() for p in lm.model.parameters())
    missing, unexpected = hf.load_state_dict(lm.model.hf_state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the embedding
    engine = build_engine(engine_spec(str(d), "none", load_format="dummy"),
                          EngineConfig(max_num_seqs=2, max_model_len=256))
    prompt = lm.tokenizer.encode("The history of the printing press", add_special_tokens=False)
    ours = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
    x = torch.tensor([prompt])
    with torch.inference_mode():
        theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_profile_tokens_are_the_tau1_tokens_on_a_dummy_shape(shape_dirs, dtype):
    spec = engine_spec(str(shape_dirs["qwen3"]), "none", decoding_layers=2, dtype=getattr(torch, dtype),
                       load_format="dummy")
    engine = build_engine(spec, EngineConfig(max_num_seqs=4, max_model_len=256, dtype=dtype))
    tok = spec.loaded.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("Once upon a time", "def quicksort(arr):",
                                                                 "The three laws of thermodynamics are")]
    base = engine.generate(prompts, SamplingParams(max_new_tokens=32, tau=1, ignore_eos=True))
    for tau in (2, 3):
        exact = engine.generate(prompts, SamplingParams(max_new_tokens=32, tau=tau, exact=True, ignore_eos=True))
        assert [r.token_ids for r in exact] == [r.token_ids for r in base]
    assert len({t for r in base for t in r.token_ids}) > 8  # not one token over and over


def test_the_tokenizer_covers_the_shapes_whole_vocabulary(tmp_path):
    d = export_shape(tiny_shape("qwen3", vocab_size=SMOL_VOCAB + 300), tmp_path / "wide")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == SMOL_VOCAB + 300
    last = SMOL_VOCAB + 299
    assert tok.decode([last]) == PLACEHOLDER.format(last)
    assert tok.encode("Hello world", add_special_tokens=False) == load_model(
        None).tokenizer.encode("Hello world", add_special_tokens=False)  # the shipped tokenizer's own ids
    cfg = json.loads((d / "config.json").read_text())
    assert tok.eos_token_id == cfg["eos_token_id"] and tok.chat_template
    plain = export_shape(tiny_shape("qwen3"), tmp_path / "base", chat_template=False)
    assert not AutoTokenizer.from_pretrained(str(plain)).chat_template


@pytest.mark.parametrize("name", preset_names())
def test_every_presets_folder_loads_in_transformers_with_our_parameter_count(tmp_path, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = preset(name)
    d = export_shape(shape, tmp_path / name)
    cfg = AutoConfig.from_pretrained(str(d))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in hf.parameters()) == param_count(ModelConfig.from_hf(json.loads(
        (d / "config.json").read_text())))
    assert cfg.vocab_size == shape.config["vocab_size"] and cfg.num_hidden_layers == shape.config["num_hidden_layers"]


def test_a_shape_that_does_not_fit_memory_is_refused_before_allocating_with_the_figures(tmp_path):
    cfg = tiny_shape("qwen3")
    cfg.update(hidden_size=65536, intermediate_size=262144, num_hidden_layers=400, num_attention_heads=512,
               num_key_value_heads=64, head_dim=128)
    d = tmp_path / "huge"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"the model's weights need [0-9.]+ GiB .* GiB available on cpu"):
        load_model(d, load_format="dummy", tokenizer=False)


def test_a_kv_pool_that_does_not_fit_is_refused_with_the_figures(shape_dirs):
    spec = engine_spec(str(shape_dirs["qwen3"]), "none", load_format="dummy")
    need = r"the KV pool and the engine's packed weights need [0-9.]+ GiB .* GiB available"
    with pytest.raises(ConfigError, match=need):
        build_engine(spec, EngineConfig(max_num_seqs=4, max_model_len=256, kv_cache_tokens=1 << 40))


@pytest.mark.parametrize(("field", "value"), [("model_type", "mixtral"), ("hidden_act", "gelu_pytorch_tanh"),
                                              ("use_sliding_window", True)])
def test_an_unsupported_architecture_names_the_field(tmp_path, field, value):
    cfg = tiny_shape("qwen3")
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        load_model(tmp_path, load_format="dummy", tokenizer=False)


def test_a_folder_without_weights_names_the_dummy_format(shape_dirs):
    from dmtd.variants.smollm2 import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors weights.*--load-format dummy"):
        load_model(shape_dirs["qwen3"])


def test_a_variant_manifest_declares_the_dmtd_split_of_a_dummy_shape(shape_dirs, tmp_path):
    """As for a real variant: the manifest names the shape folder as its base and the split; the engine runs it."""
    manifest = {"name": "tiny-d2", "base_model": str(shape_dirs["llama"]), "num_thinking_layers": 2,
                "num_decoding_layers": 2, "tau_max": 4, "default_tau": 3}
    (tmp_path / "variant.json").write_text(json.dumps(manifest))
    spec = engine_spec(None, str(tmp_path / "variant.json"), load_format="dummy")
    assert (spec.dmtd.num_thinking_layers, spec.dmtd.num_decoding_layers, spec.default_tau) == (2, 2, 3)
    engine = build_engine(spec, EngineConfig(max_num_seqs=1, max_model_len=128))
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=9, ignore_eos=True))[0]
    assert len(out.token_ids) == 9 and out.mean_block_len > 1.0  # τ = 3 cycles: tails emit their tokens


def test_a_bfloat16_replica_holds_its_layer_weights_once_and_writes_the_same_tokens(shape_dirs):
    from dmtd.engine import lowbit
    from dmtd.engine.llm import LLMEngine

    if lowbit.weight_format("bfloat16", "none") != "bf16":
        pytest.skip("no bf16 kernels on this machine: the engine multiplies the dense weights")
    cfg = EngineConfig(max_num_seqs=2, max_model_len=256, dtype="bfloat16")
    spec = engine_spec(str(shape_dirs["qwen3"]), "none", decoding_layers=2, dtype=torch.bfloat16, load_format="dummy")
    two = engine_spec(str(shape_dirs["qwen3"]), "none", decoding_layers=2, dtype=torch.bfloat16, load_format="dummy")
    packed, dense = build_engine(spec, cfg), LLMEngine(two.loaded.model, two.loaded.tokenizer, two.dmtd, cfg)
    layer = spec.loaded.model.layers[0].mlp.gate_up_proj
    assert layer.weight.numel() == 0 and packed.runner.weights[0].gate_up is layer.packed
    assert two.loaded.model.layers[0].mlp.gate_up_proj.weight.numel() > 0  # the runner packed a copy beside it
    tok = spec.loaded.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("Once upon a time", "def quicksort(arr):")]
    for p in (SamplingParams(max_new_tokens=16, tau=1, ignore_eos=True),
              SamplingParams(max_new_tokens=16, tau=3, exact=True, ignore_eos=True)):
        assert [r.token_ids for r in packed.generate(prompts, p)] == [r.token_ids for r in dense.generate(prompts, p)]
