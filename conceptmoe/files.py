"""Files written whole: strict JSON replaced atomically (a reader sees the old file or the new one,
never half of either). Shared by every part of the package, like ``errors``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically: temp file in the same directory, then rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")  # strict JSON
    os.replace(tmp, path)
