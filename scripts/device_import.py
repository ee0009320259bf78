"""Turn what ``scripts/device_train.py`` sent back into a variant directory beside the shipped one.

Joins the files' parts (``NAME.partK``), checks each tensor file against the SHA-256 its ``variant.json`` records,
and takes from the shipped variant what training does not make: its draft vocabulary and serving fields
(``draft_vocab``, ``draft_threshold``, ``default_profile``, ``verifier``, ``dtype``, ``quant``). The result loads
like any variant (``--variant DIR``); compare it with the shipped one before replacing it:

    .venv/bin/python scripts/device_import.py RESULTS candidates/smollm2-gpu-1
    .venv/bin/python scripts/heldout_agreement.py 64 platform/dmtd/variants/shipped/smollm2-135m-dmtd \\
        candidates/smollm2-gpu-1
    .venv/bin/dmtd bench exact --configs a3:0 --variants smollm2-135m-dmtd,candidates/smollm2-gpu-1
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from dmtd.variants.manifest import MANIFEST_NAME, read_manifest, sha256_file
from dmtd.variants.paths import SHIPPED_VARIANTS

SERVING_FIELDS = ("draft_threshold", "default_profile", "verifier", "dtype", "quant")


def join_parts(src: Path, dst: Path) -> list[str]:
    """``NAME.part0``, ``NAME.part1``, … → ``dst/NAME``; returns the names joined."""
    parts: dict[str, list[tuple[int, Path]]] = {}
    for f in src.iterdir():
        m = re.fullmatch(r"(.+)\.part(\d+)", f.name)
        if m:
            parts.setdefault(m.group(1), []).append((int(m.group(2)), f))
    for name, ps in parts.items():
        ps.sort()
        if [k for k, _ in ps] != list(range(len(ps))):
            raise SystemExit(f"{src}: the parts of {name} are not 0..{len(ps) - 1}")
        with (dst / name).open("wb") as out:
            for _, f in ps:
                out.write(f.read_bytes())
    return sorted(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="the folder device_train.py wrote (its --out)")
    ap.add_argument("out", type=Path, help="the variant directory to make (must not exist)")
    ap.add_argument("--like", type=Path, default=SHIPPED_VARIANTS / "smollm2-135m-dmtd",
                    help="the variant whose draft vocabulary and serving fields it takes")
    args = ap.parse_args()
    if args.out.exists():
        print(f"{args.out} exists: choose another directory", file=sys.stderr)
        return 2
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    joined = join_parts(args.results, tmp)
    if MANIFEST_NAME not in joined:
        print(f"{args.results}: no {MANIFEST_NAME}.part0 (did the run export?)", file=sys.stderr)
        return 2
    m = json.loads((tmp / MANIFEST_NAME).read_text())
    for key in ("weights", "adapter"):
        if key in m and sha256_file(tmp / m[key]) != m[f"{key}_sha256"]:
            print(f"{m[key]} does not match the SHA-256 in {MANIFEST_NAME}", file=sys.stderr)
            return 2
    keep = {MANIFEST_NAME, *(m[k] for k in ("weights", "adapter", "heldout") if k in m)}
    for f in tmp.iterdir():  # e.g. the full-rank int8 tensors: not a variant file
        if f.name not in keep:
            f.unlink()
    like = json.loads((args.like / MANIFEST_NAME).read_text())
    if like["base_fingerprint"] != m["base_fingerprint"]:
        print(f"{args.like} was made from another base model", file=sys.stderr)
        return 2
    if "draft_vocab" in like:
        shutil.copyfile(args.like / like["draft_vocab"], tmp / like["draft_vocab"])
        m.update(draft_vocab=like["draft_vocab"], draft_vocab_sha256=like["draft_vocab_sha256"])
    m.update({k: like[k] for k in SERVING_FIELDS if k in like})
    report = args.results / "report.json"
    if report.is_file():
        r = json.loads(report.read_text())
        m["recipe"]["device_report"] = {k: r[k] for k in ("device", "generated", "train", "init", "final",
                                                          "corpus_tokens") if k in r}
    (tmp / MANIFEST_NAME).write_text(json.dumps(m, indent=1) + "\n")
    read_manifest(tmp)  # the manifest is one the loader accepts
    tmp.rename(args.out)
    print(f"{args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
