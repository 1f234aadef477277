"""The seed-scale run: `dynquant quantize seed --random-init` with the seed's own widths.

Wall time, throughput (weights per second) and peak RSS, against the size of the dense model
(what streaming module by module saves).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import figure, machine, run_child

SEED_WIDTHS = Path(__file__).parents[1] / "tests" / "data" / "seed_dynquant.json"


def main() -> None:
    print(f"# seed-scale quantize (1.69 B weights, random init), {machine()}")
    out = Path(tempfile.mkdtemp()) / "seed"
    try:
        wall, rss = run_child(["-m", "dynquant", "quantize", "seed", "--random-init",
                               "--widths", str(SEED_WIDTHS), "-o", str(out), "--quiet"])
        doc = json.loads((out / "dynquant.json").read_text())
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    weights = doc["accounting"]["quantized_elements"]
    dense_bf16 = 2 * weights + doc["accounting"]["dense_nbytes"]
    figure("wall time", wall, "s")
    figure("throughput", weights / wall / 1e6, "M weights/s")
    figure("peak RSS", rss / 2**30, "GiB")
    figure("peak RSS / dense bf16 model", rss / dense_bf16, "x")
    figure("checkpoint total_nbytes", doc["accounting"]["total_nbytes"] / 2**20, "MiB")


if __name__ == "__main__":
    main()
