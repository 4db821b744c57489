"""Records written by the tests themselves: coloured squares for diffusion, echo pairs for LMs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def write_image_records(folder: Path, *, size: int = 64, n: int = 8) -> Path:
    """``n`` rows of a flat square of one colour on white, captioned with the colour."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    names = list(COLOURS)
    for i in range(n):
        name = names[i % len(names)]
        img = np.full((size, size, 3), 255, dtype=np.uint8)
        lo = size // 4 + (i % 3) * 2
        img[lo:lo + size // 2, lo:lo + size // 2] = COLOURS[name]
        Image.fromarray(img).save(folder / f"{i:03d}.png")
        rows.append({"caption": f"a {name} square", "image": f"{i:03d}.png"})
    path = folder / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_text_records(folder: Path, *, n: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"{a} + {a} =", "completion": f" {2 * a}"} for a in range(1, n + 1)]
    path = folder / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def image_records(tmp_path) -> Path:
    return write_image_records(tmp_path / "data")


@pytest.fixture
def text_records(tmp_path) -> Path:
    return write_text_records(tmp_path / "data")
