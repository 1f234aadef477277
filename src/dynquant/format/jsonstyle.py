"""The one-line JSON style of dynquant.json: ``{ "k": v, "l": [ 1, 2 ] }`` (spaces inside brackets).

Written byte-for-byte like the seed document, so that the same metadata always gives the same bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(value: Any) -> str:
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in value.items())
        return "{ " + items + " }"
    if isinstance(value, list | tuple):
        return "[ " + ", ".join(dumps(v) for v in value) + " ]" if value else "[]"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"non-finite float {value!r} cannot be written to dynquant.json")
    return json.dumps(value)
