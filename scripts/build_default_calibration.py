"""Build the calibration text that ships inside the package (``src/dynquant/data/``).

``dynquant measure`` / ``quantize --budget`` calibrate on it when no ``--calib`` is given. It
mixes three kinds of English so that no single register dominates the activation statistics:
encyclopedic prose (WikiText-2 *validation*, detokenized, paragraphs with ``<unk>`` left out),
simple narrative (TinyStories, from the part the reference models trained on, never the
held-out tail) and dialogue/verse (Shakespeare). The pieces are interleaved in chunks of about
2,000 characters: calibration windows are spread evenly over the text, so every window count
sees every register. Nothing of ``data/heldout.txt`` (TinyStories' last 8 %, WikiText-2 test)
is in it.

    python scripts/build_default_calibration.py --data-dir ../shared/data

Deterministic: the same corpora give the same bytes (checked by SHA-256 in the README).
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
OUT = ROOT / "src" / "dynquant" / "data" / "calibration_default.txt"
CHUNK = 2000  # characters per interleaved piece
# corpus -> (characters taken, where in the file to start as a fraction, usable fraction)
PLAN = {"wikitext2_valid.txt": (36000, 0.1, 1.0),
        "tinystories_valid.txt": (16000, 0.3, 0.92),  # the reference models' training part
        "shakespeare.txt": (12000, 0.5, 1.0)}
WIKI_FIXES = [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" ,", ","), (" .", "."),
              (" ;", ";"), (" :", ":"), (" 's", "'s"), ("( ", "("), (" )", ")"), (" n't", "n't")]


def wiki_paragraphs(text: str) -> list[str]:
    """WikiText-2's tokenized paragraphs as plain text; headings and <unk> paragraphs dropped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("=") or "<unk>" in line or len(line) < 200:
            continue
        for old, new in WIKI_FIXES:
            line = line.replace(old, new)
        out.append(re.sub(r'" (.*?) "', r'"\1"', line))
    return out


def paragraphs(name: str, text: str) -> list[str]:
    if name.startswith("wikitext"):
        return wiki_paragraphs(text)
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]


def pieces(name: str, text: str, chars: int, start: float, usable: float) -> list[str]:
    """Consecutive paragraphs from ``start`` (a fraction of the usable text), grouped into
    pieces of about CHUNK characters, ``chars`` in all."""
    paras = paragraphs(name, text[: int(len(text) * usable)])
    paras = paras[int(len(paras) * start):]
    out, piece, total = [], [], 0
    for p in paras:
        piece.append(p)
        if sum(map(len, piece)) >= CHUNK:
            out.append("\n\n".join(piece))
            total += len(out[-1])
            piece = []
            if total >= chars:
                break
    return out


def build(data_dir: Path) -> str:
    streams = [pieces(name, (data_dir / name).read_text(encoding="utf-8"), *plan)
               for name, plan in PLAN.items()]
    # interleave by share: at each step the stream furthest behind its quota gives a piece
    taken = [0] * len(streams)
    quota = [plan[0] for plan in PLAN.values()]
    out = []
    while any(t < len(s) for t, s in zip(taken, streams, strict=True)):
        i = min((i for i, s in enumerate(streams) if taken[i] < len(s)),
                key=lambda i: sum(map(len, streams[i][:taken[i]])) / quota[i])
        out.append(streams[i][taken[i]])
        taken[i] += 1
    return "\n\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    args = parser.parse_args()
    text = build(args.data_dir)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    digest = hashlib.sha256(text.encode()).hexdigest()
    print(f"{OUT}: {len(text):,} characters, sha256 {digest}")


if __name__ == "__main__":
    main()
