"""Where every benchmark script leaves its numbers: bench/results/NAME.json."""
import json
from pathlib import Path


def save(name: str, data: dict, indent: int = 2) -> Path:
    out = Path(__file__).parent / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(data, indent=indent) + "\n")
    return out
