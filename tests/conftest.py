from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import dynquant  # noqa: F401  (before torch, as users are told to: OpenMP's short spin)

# The suite holds packed models to float32 references, so "auto" activations mean float32
# here; the int8 products are tested where asked for (tests/test_int8_activations.py, the
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
