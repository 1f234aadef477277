from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# pytest-xdist's workers share the cores: threads of their own (torch's, the BLAS's, those of the
# processes a test starts) would oversubscribe them; the tests of threaded paths set their own
# counts. Set before anything loads torch or a BLAS.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import dynquant  # noqa: F401  (before torch, as users are told to: OpenMP's short spin)

# The suite holds packed models to float32 references, so "auto" activations mean float32
# here; the int8 products are tested where asked for (tests/numerics/test_int8_activations.py, the
# families' int8 test), and the default itself by test_the_activations_setting, without this.
os.environ.setdefault("DYNQUANT_ACTIVATIONS", "float")

DATA = Path(__file__).parent / "data"
SEED = DATA / "seed_dynquant.json"


@pytest.fixture(scope="session")
def seed_path() -> Path:
    return SEED


@pytest.fixture(scope="session")
def seed_doc() -> dict:
    return json.loads(SEED.read_text())


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A factory of tiny uniform-width checkpoints, each written once per test process and
    shared: ``tiny_checkpoint(model="tiny", bits=4, tokenizer=0)`` -> its folder. ``model``:
    the ``tiny`` preset (the reference hybrid, random weights) or a model_zoo family (a saved
    random model, with a trained tokenizer of ``tokenizer`` tokens when given). Read only: a test
    that changes a checkpoint writes its own."""
    from dynquant.models.sources import resolve_model
    from dynquant.pipeline.codes.write import quantize_model
    from model_zoo import save_tiny_model, save_tiny_tokenizer

    built: dict[tuple, Path] = {}

    def make(model: str = "tiny", bits: int = 4, tokenizer: int = 0) -> Path:
        key = (model, bits, tokenizer)
        if key not in built:
            root = tmp_path_factory.mktemp(f"checkpoint-{model}-{bits}")
            if model == "tiny":
                source = resolve_model("tiny")
            else:
                src = save_tiny_model(model, root / "src")
                if tokenizer:
                    save_tiny_tokenizer(src, vocab_size=tokenizer)
                source = resolve_model(str(src))
            widths = {s.module: bits for s in source.tensor_specs() if s.quantizable}
            quantize_model(source, widths, root / "q", random_init=model == "tiny",
                           progress=False)
            built[key] = root / "q"
        return built[key]

    return make
