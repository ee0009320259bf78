"""``dmtd variants …`` through ``python -m dmtd.registry.cli`` against the test redis-server."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dmtd.registry.cli import main
from dmtd_contract.registry import RegistryClient


def variant_dir(root: Path, name: str = "smollm2-d8", **manifest: object) -> Path:
    """A variant folder: variant.json and a weights file beside it, with its real SHA-256."""
    folder = root / name
    (folder / "w").mkdir(parents=True)
    weights = folder / "w" / "model.safetensors"
    weights.write_bytes(b"trained tensors " * 64)
    data: dict[str, object] = {"name": name, "base_model": "smollm2", "num_thinking_layers": 22,
                               "num_decoding_layers": 8, "tau_max": 4, "default_tau": 3,
                               "head_input": "residual_add", "weights": "w/model.safetensors",
                               "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
                               "recipe": {"lr": 1e-4}}
    data.update(manifest)
    (folder / "variant.json").write_text(json.dumps(data))
    return folder


def dmtd(url: str | None, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("DMTD_REGISTRY_URL", None)
    if url is not None:
        full_env["DMTD_REGISTRY_URL"] = url
    return subprocess.run([sys.executable, "-m", "dmtd.registry.cli", "variants", *argv], capture_output=True,
                          text=True, env=full_env, timeout=60)


def test_register_list_show_promote_weight_retire(registry_url: str, tmp_path: Path) -> None:
    folder = variant_dir(tmp_path)
    got = dmtd(registry_url, "register", str(folder), "--tau-min", "2")
    assert got.returncode == 0, got.stderr
    assert "registered smollm2-d8: staged" in got.stdout

    got = dmtd(registry_url, "promote", "smollm2-d8", "--default", "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["status"] == "active"

    got = dmtd(None, "set-weight", "smollm2-d8", "25%", "--registry", registry_url)
    assert got.returncode == 0, got.stderr
    assert "weight 0.25" in got.stdout

    got = dmtd(registry_url, "list")
    assert got.returncode == 0, got.stderr
    header, row, footer = got.stdout.strip().splitlines()
    assert header.split() == ["NAME", "STATUS", "DEFAULT", "WEIGHT", "SHARE", "TAU", "MIN_CONF", "PROFILE",
                              "VERIFIER", "E/T/D", "REV", "BASE"]
    # the weights file is no safetensors file: its tensors, and so the verifier, are unknown ("?")
    assert row.split() == ["smollm2-d8", "active", "*", "0.25", "100%", "2..4", "(3)", "0", "dmtd", "?", "0/22/8",
                           "3", "smollm2"]
    assert footer == "registry revision 3, 1 variant(s)"

    got = dmtd(registry_url, "show", "smollm2-d8", "--json")
    assert got.returncode == 0, got.stderr
    shown = json.loads(got.stdout)
    assert shown["weights_uri"] == str(folder / "w" / "model.safetensors")
    assert shown["manifest_uri"] == str(folder / "variant.json")
    assert (shown["is_default"], shown["tau_min"], shown["revision"]) == (True, 2, 3)

    got = dmtd(registry_url, "retire", "smollm2-d8")
    assert got.returncode == 0 and "retired smollm2-d8: retired" in got.stdout
    with RegistryClient(registry_url) as client:
        assert client.get("smollm2-d8").status == "retired" and client.default_name() is None


def test_bad_input_exits_2_naming_field_and_rule(registry_url: str, tmp_path: Path) -> None:
    got = dmtd(registry_url, "register", str(variant_dir(tmp_path, default_tau=6)))
    assert got.returncode == 2
    assert "invalid variant: default_tau: must lie in [tau_min, tau_max] = [1, 4], got 6" in got.stderr
    got = dmtd(registry_url, "show", "ghost")
    assert got.returncode == 2 and "variant 'ghost' not found" in got.stderr
    with RegistryClient(registry_url) as client:
        assert client.list() == [] and client.revision() == 0


@pytest.mark.parametrize(("argv", "needle"), [
    (["set-weight", "v", "1.5"], "traffic_weight: input should be less than or equal to 1"),
    (["set-weight", "v", "lots"], "traffic_weight: must be a number in [0, 1] or a percentage"),
    (["set", "v", "--tau-min", "9"], "tau_min: must be <= tau_max (4), got 9"),
    (["set", "v"], "fields: give at least one of --min-confidence, --tau-min, --tau-max, --default-tau, "
                   "--default-profile, --description"),
    (["promote", "ghost"], "variant 'ghost' not found"),
    (["retire", "ghost"], "variant 'ghost' not found"),
])
def test_handler_errors_exit_2(registry_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               argv: list[str], needle: str) -> None:
    assert main(["variants", "register", str(variant_dir(tmp_path, "v")), "--registry", registry_url]) == 0
    capsys.readouterr()
    assert main(["variants", *argv, "--registry", registry_url]) == 2
    assert needle in capsys.readouterr().err
    with RegistryClient(registry_url) as client:
        assert client.get("v").revision == 1, "a refused change writes nothing"


def test_register_checks_files_and_duplicates(registry_url: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = variant_dir(tmp_path, "v")
    (folder / "w" / "model.safetensors").write_bytes(b"tampered")
    assert main(["variants", "register", str(folder), "--registry", registry_url]) == 2
    assert "weights_sha256: must match the SHA-256 of" in capsys.readouterr().err
    assert main(["variants", "register", str(folder / "variant.json"), "--no-verify", "--status", "active",
                 "--registry", registry_url]) == 0
    assert main(["variants", "register", str(folder), "--no-verify", "--registry", registry_url]) == 2
    assert "'v' already exists" in capsys.readouterr().err
    assert main(["variants", "register", str(tmp_path / "nowhere"), "--registry", registry_url]) == 2
    assert "manifest: file" in capsys.readouterr().err
    assert main(["variants", "list", "--status", "active", "--json", "--registry", registry_url]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert (listed["revision"], listed["default"], [v["name"] for v in listed["variants"]]) == (1, "v", ["v"])


def test_unreachable_registry_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["variants", "list", "--registry", "redis://127.0.0.1:1/0"]) == 1
    assert "unavailable" in capsys.readouterr().err


def safetensors_variant(root: Path, name: str, tensors: list[str], kind: str = "weights", **manifest: object) -> Path:
    """A variant folder whose weights (or adapter) file is a real safetensors file holding ``tensors``."""
    import torch
    from safetensors.torch import save_file

    folder = root / name
    folder.mkdir(parents=True)
    path = folder / f"{kind}.safetensors"
    save_file({t: torch.zeros(2, 2) for t in tensors}, str(path))
    data: dict[str, object] = {"name": name, "num_thinking_layers": 22, "num_decoding_layers": 8, "tau_max": 4,
                               "default_tau": 3, kind: path.name,
                               f"{kind}_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), **manifest}
    (folder / "variant.json").write_text(json.dumps(data))
    return folder


def test_entries_name_their_default_profile_and_verifier(registry_url: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Registered from manifests: the default profile as given, the verifier read off the files' tensors."""
    decoding = safetensors_variant(tmp_path, "dec", ["layers.22.input_layernorm.weight",
                                                     "layers.29.mlp.down_proj.weight"], default_profile="exact")
    thinking = safetensors_variant(tmp_path, "think", ["layers.3.self_attn.o_proj.weight.lora_A",
                                                       "layers.3.self_attn.o_proj.weight.lora_B"], kind="adapter")
    for folder in (decoding, thinking):
        assert main(["variants", "register", str(folder), "--status", "active", "--registry", registry_url]) == 0
    capsys.readouterr()
    with RegistryClient(registry_url) as client:
        dec, think = client.get("dec"), client.get("think")
    assert (dec.default_profile, dec.verifier) == ("exact", "base")
    assert (think.default_profile, think.verifier) == ("dmtd", "variant")
    got = dmtd(registry_url, "list")
    rows = {line.split()[0]: line.split() for line in got.stdout.splitlines()[1:-1]}
    assert rows["dec"][-5:-3] == ["exact", "base"] and rows["think"][-5:-3] == ["dmtd", "variant"]

    assert main(["variants", "set", "dec", "--default-profile", "dmtd", "--registry", registry_url]) == 0
    with RegistryClient(registry_url) as client:
        assert client.get("dec").default_profile == "dmtd" and client.get("dec").revision == 2
    got = dmtd(registry_url, "set", "dec", "--default-profile", "fast")
    assert got.returncode == 2 and "--default-profile: invalid choice: 'fast'" in got.stderr
    # a manifest that names its verifier keeps it; one whose name contradicts a field is refused
    named = safetensors_variant(tmp_path, "named", ["layers.3.mlp.down_proj.weight"], verifier="base")
    assert main(["variants", "register", str(named), "--registry", registry_url]) == 0
    with RegistryClient(registry_url) as client:
        assert client.get("named").verifier == "base"
    bad = safetensors_variant(tmp_path, "bad", ["layers.22.input_layernorm.weight"], default_profile="fast")
    capsys.readouterr()
    assert main(["variants", "register", str(bad), "--registry", registry_url]) == 2
    assert "default_profile: input should be 'dmtd' or 'exact'" in capsys.readouterr().err
