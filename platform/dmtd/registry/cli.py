"""``dmtd variants list|show|register|promote|retire|set-weight|set``: the registry from the command line.

Exit codes: 0 done; 2 bad input or an unknown/existing variant (the message names the field and rule, or
says "not found"); 1 the registry is unavailable. Run standalone as ``python -m dmtd.registry.cli variants …``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dmtd.registry.embedded import ENV_URL, EmbeddedRedis, registry_url
from dmtd_contract.registry.client import RegistryClient
from dmtd_contract.registry.entry import VariantEntry, VariantSpec
from dmtd_contract.registry.errors import InvalidVariant, RegistryConflict, RegistryError, RegistryUnavailable
from dmtd_contract.registry.routing import RegistrySnapshot
from dmtd_contract.variant_schema import DEFAULT_PROFILES, STATUSES

EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE = 0, 1, 2
MANIFEST_NAME = "variant.json"
# Manifest fields the registry does not keep but that are valid (they describe how the variant was made).
_MANIFEST_ONLY = {"base_fingerprint", "vocab_size", "recipe", "data_hash", "eval", "heldout", "draft_vocab",
                  "draft_vocab_sha256", "dtype", "quant"}
_KEPT = {"name", "base_model", "weights", "weights_sha256", "adapter", "adapter_sha256", "num_encoding_layers",
         "num_thinking_layers", "num_decoding_layers", "tau_max", "default_tau", "min_confidence",
         "phase_anchor", "head_input", "description", "default_profile", "verifier"}
_SETTABLE = ("min_confidence", "tau_min", "tau_max", "default_tau", "default_profile", "description")

Handler = Callable[[argparse.Namespace, RegistryClient], int]


def add_variants_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``variants`` and its subcommands to an ``argparse`` subparsers object; each sets ``func(args) -> int``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--registry", default=None, metavar="URL",
                        help=f"registry URL, e.g. redis://127.0.0.1:6379/0 (default: ${ENV_URL}, else the "
                        "embedded registry under ~/.cache/dmtd/registry)")
    common.add_argument("--namespace", default="dmtd", help=argparse.SUPPRESS)
    common.add_argument("--json", action="store_true", help="print JSON instead of text")

    v: argparse.ArgumentParser = subparsers.add_parser(
        "variants", help="the variant registry: list, show, register, promote, retire, set-weight, set")
    vsub = v.add_subparsers(dest="variants_command", required=True, metavar="COMMAND")

    p = vsub.add_parser("list", parents=[common], help="list variants as a table")
    p.add_argument("--status", choices=STATUSES, default=None, help="only variants in this status")
    p.set_defaults(func=_handler(cmd_list))

    p = vsub.add_parser("show", parents=[common], help="every field of one variant")
    p.add_argument("name")
    p.set_defaults(func=_handler(cmd_show))

    p = vsub.add_parser("register", parents=[common], help="register a variant from its manifest (all or nothing)")
    p.add_argument("manifest", type=Path, help=f"a manifest file or a variant folder holding {MANIFEST_NAME}")
    p.add_argument("--status", choices=("staged", "active"), default="staged", help="initial status (staged)")
    p.add_argument("--weight", default="0", help="traffic weight, 0..1 or a percentage like 10%% (0)")
    p.add_argument("--tau-min", type=int, default=1, help="smallest τ a replica may choose (1)")
    p.add_argument("--default", action="store_true", help="make it the default variant (needs --status active)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not check local weight/adapter files against their SHA-256")
    p.set_defaults(func=_handler(cmd_register))

    p = vsub.add_parser("promote", parents=[common], help="staged or retired -> active")
    p.add_argument("name")
    p.add_argument("--default", action="store_true", help="also make it the default variant")
    p.set_defaults(func=_handler(cmd_promote))

    p = vsub.add_parser("retire", parents=[common], help="-> retired (no traffic; clears the default if it was)")
    p.add_argument("name")
    p.set_defaults(func=_handler(cmd_retire))

    p = vsub.add_parser("set-weight", parents=[common], help="set the canary traffic weight")
    p.add_argument("name")
    p.add_argument("weight", help="0..1, or a percentage like 10%%")
    p.set_defaults(func=_handler(cmd_set_weight))

    p = vsub.add_parser("set", parents=[common],
                        help="change min_confidence / τ range / default profile (replicas apply it live)")
    p.add_argument("name")
    p.add_argument("--min-confidence", type=float, default=None)
    p.add_argument("--tau-min", type=int, default=None)
    p.add_argument("--tau-max", type=int, default=None)
    p.add_argument("--default-tau", type=int, default=None)
    p.add_argument("--default-profile", choices=DEFAULT_PROFILES, default=None,
                   help="profile of requests that name none: 'dmtd' or 'exact' (verified cycles)")
    p.add_argument("--description", default=None)
    p.set_defaults(func=_handler(cmd_set))
    return v


def cmd_list(args: argparse.Namespace, client: RegistryClient) -> int:
    snap = client.snapshot()
    entries = snap.list(args.status)
    if args.json:
        _print_json({"revision": snap.revision, "default": snap.default_name,
                     "variants": [e.model_dump() for e in entries]})
    else:
        print(format_table(snap, entries))
    return EXIT_OK


def cmd_show(args: argparse.Namespace, client: RegistryClient) -> int:
    snap = client.snapshot()
    entry = snap.get(args.name)
    data = {**entry.model_dump(), "is_default": snap.default_name == entry.name,
            "loads": {r: why or "served" for r, why in sorted(client.load_reports(entry.name).items())}}
    if args.json:
        _print_json(data)
    else:
        width = max(len(k) for k in data)
        for key, value in data.items():
            print(f"{key:<{width}}  {'' if value is None else value}")
    return EXIT_OK


def cmd_register(args: argparse.Namespace, client: RegistryClient) -> int:
    path = args.manifest / MANIFEST_NAME if args.manifest.is_dir() else args.manifest
    data = read_manifest_dict(path)
    spec = VariantSpec.from_manifest(data, path, tau_min=args.tau_min)
    if not args.no_verify:
        verify_files(spec)
    entry = client.register(spec, status=args.status, traffic_weight=parse_weight(args.weight),
                            make_default=args.default)
    return _report(args, entry, "registered")


def cmd_promote(args: argparse.Namespace, client: RegistryClient) -> int:
    return _report(args, client.promote(args.name, make_default=args.default), "promoted")


def cmd_retire(args: argparse.Namespace, client: RegistryClient) -> int:
    return _report(args, client.retire(args.name), "retired")


def cmd_set_weight(args: argparse.Namespace, client: RegistryClient) -> int:
    return _report(args, client.set_weight(args.name, parse_weight(args.weight)), "set weight of")


def cmd_set(args: argparse.Namespace, client: RegistryClient) -> int:
    fields = {k: getattr(args, k) for k in _SETTABLE if getattr(args, k) is not None}
    if not fields:
        raise InvalidVariant("fields", "give at least one of " + ", ".join("--" + k.replace("_", "-")
                                                                            for k in _SETTABLE))
    return _report(args, client.update(args.name, **fields), "updated")


def read_manifest_dict(path: Path) -> dict[str, Any]:
    """The manifest's JSON object; warns about fields neither the registry nor the manifest format knows."""
    if not path.is_file():
        raise InvalidVariant("manifest", f"file {str(path)!r} not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidVariant("manifest", f"{path} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise InvalidVariant("manifest", f"{path} must hold a JSON object")
    unknown = sorted(set(data) - _KEPT - _MANIFEST_ONLY)
    if unknown:
        print(f"warning: {path}: fields not kept by the registry: {', '.join(unknown)}", file=sys.stderr)
    return data


def verify_files(spec: VariantSpec) -> None:
    """Check local weight/adapter files exist and match their SHA-256 (remote URIs are not fetched)."""
    for kind in ("weights", "adapter"):
        uri, sha = getattr(spec, f"{kind}_uri"), getattr(spec, f"{kind}_sha256")
        if uri is None or "://" in uri:
            continue
        file = Path(uri)
        if not file.is_file():
            raise InvalidVariant(f"{kind}_uri", f"file {uri!r} not found (use --no-verify to register anyway)")
        if _sha256(file) != sha:
            raise InvalidVariant(f"{kind}_sha256", f"must match the SHA-256 of {uri!r}")


def parse_weight(text: str) -> float:
    """``0.25`` or ``25%`` -> 0.25; the range is checked by the entry."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise InvalidVariant("traffic_weight", f"must be a number in [0, 1] or a percentage like 10%, "
                             f"got {text!r}") from None


def format_table(snap: RegistrySnapshot, entries: list[VariantEntry]) -> str:
    """The ``variants list`` table; ``share`` is the fraction of unnamed requests the variant receives."""
    shares = snap.traffic_shares()
    head = ("NAME", "STATUS", "DEFAULT", "WEIGHT", "SHARE", "TAU", "MIN_CONF", "PROFILE", "VERIFIER", "E/T/D", "REV",
            "BASE")
    rows = [(e.name, e.status, "*" if e.name == snap.default_name else "", f"{e.traffic_weight:g}",
             f"{shares.get(e.name, 0.0):.0%}", f"{e.tau_min}..{e.tau_max} ({e.default_tau})",
             f"{e.min_confidence:g}", e.default_profile, e.verifier or "?",
             f"{e.num_encoding_layers}/{e.num_thinking_layers}/{e.num_decoding_layers}", str(e.revision),
             e.base_model) for e in entries]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    lines.append(f"registry revision {snap.revision}, {len(entries)} variant(s)")
    return "\n".join(lines)


def _report(args: argparse.Namespace, entry: VariantEntry, verb: str) -> int:
    if args.json:
        _print_json(entry.model_dump())
    else:
        print(f"{verb} {entry.name}: {entry.status}, weight {entry.traffic_weight:g}, revision {entry.revision} "
              f"(registry revision {entry.registry_revision})")
    return EXIT_OK


def _handler(fn: Handler) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            with open_client(args.registry, args.namespace) as client:
                return fn(args, client)
        except (RegistryUnavailable, RegistryConflict) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        except RegistryError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE

    return run


@contextmanager
def open_client(url: str | None = None, namespace: str = "dmtd") -> Iterator[RegistryClient]:
    """A client of ``url`` / ``$DMTD_REGISTRY_URL``, else of the embedded registry (started and stopped here)."""
    url = registry_url(url)
    if url is not None:
        with RegistryClient(url, namespace=namespace) as client:
            yield client
        return
    with EmbeddedRedis() as server, RegistryClient(server.url, namespace=namespace) as client:
        yield client


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    """``python -m dmtd.registry.cli variants …`` (the same commands ``dmtd variants`` wires in)."""
    parser = argparse.ArgumentParser(prog="dmtd")
    add_variants_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
