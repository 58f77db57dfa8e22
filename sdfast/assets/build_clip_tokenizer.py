"""Regenerate ``clip/vocab.json`` and ``clip/merges.txt`` (the CLIP BPE tokenizer SD uses).

Source: ``open_clip/bpe_simple_vocab_16e6.txt.gz`` from the ``open_clip_torch`` wheel (MIT; the BPE
merges OpenAI released with CLIP). The vocabulary is built the way CLIP builds it: the 256 byte
symbols, the same with ``</w>``, one token per merge (first 48894 merges), then the start/end tokens:
49408 ids in all. Run by hand (developer tool, never at run time):

    pip download --no-deps -d /tmp/oc open_clip_torch
    python -m sdfast.assets.build_clip_tokenizer /tmp/oc/open_clip_torch-*.whl
"""

from __future__ import annotations

import gzip
import json
import sys
import zipfile
from pathlib import Path


N_MERGES = 49152 - 256 - 2


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from the 256 byte values to printable unicode symbols."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, codes)))


def build(wheel: str, out_dir: Path) -> None:
    raw = zipfile.ZipFile(wheel).read("open_clip/bpe_simple_vocab_16e6.txt.gz")
    lines = gzip.decompress(raw).decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in lines[1 : N_MERGES + 1]]
    vocab = list(bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}, ensure_ascii=False))
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")


if __name__ == "__main__":
    build(sys.argv[1], Path(__file__).parent / "clip")
