"""JSON-lines files written whole: a reader never sees half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> str:
    """Write rows as JSON lines through a temporary file and a rename: complete or absent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return str(path)
