"""The shapes world as an SFT record source (``data.source: shapes`` of an SFT recipe): generated captioned images."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from examples.shapes.data import make_dataset
from unirl_core.errors import ConfigError, field_error


@dataclass(frozen=True, kw_only=True)
class ShapesSourceConfig:
    """The generated shapes world (``examples.shapes.data.make_dataset``)."""

    num_records: int = 4096
    """Images generated once per process (a fixed training set)."""
    seed: int = 0
    """Seed of the generator."""


def shapes_records(cfg) -> list:
    """Generated captioned images (``ImageRecord``) of the shapes world, ``diffusion.height`` pixels square."""
    from unirl_core.sft.records import ImageRecord

    size = cfg.diffusion.height
    if cfg.diffusion.width != size:
        raise field_error(ConfigError, "diffusion.width", cfg.diffusion.width, f"= diffusion.height ({size})",
                          "the shapes world renders square images")
    src = cfg.data.section("shapes")
    return [ImageRecord(c, np.asarray(img, dtype=np.uint8))
            for c, img in make_dataset(src.num_records, seed=src.seed, size=size)]
