from __future__ import annotations

import json
from pathlib import Path

import pytest

import dynquant  # noqa: F401  (before torch, as users are told to: OpenMP's short spin)

DATA = Path(__file__).parent / "data"
SEED = DATA / "seed_dynquant.json"


@pytest.fixture(scope="session")
def seed_path() -> Path:
    return SEED


@pytest.fixture(scope="session")
def seed_doc() -> dict:
    return json.loads(SEED.read_text())
