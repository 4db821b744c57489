"""RNG capture/restore so a resumed run draws the same random numbers as the uninterrupted one."""

from __future__ import annotations

import random

import numpy as np
import torch

from unirl_core.errors import CheckpointError, field_error


def capture_rng() -> dict[str, object]:
    """Torch CPU/CUDA, Python and NumPy generator states as tensors, ints and lists (loadable weights_only)."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        # the current device's generator only: a process trains on one device, and the process that resumes may
        # see another number of devices (a pool actor sees its own GPU where the run's setup process saw all)
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_kind, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss),
                  float(np_gauss)],
    }


def restore_rng(state: dict[str, object]) -> None:
    """Inverse of :func:`capture_rng`."""
    try:
        torch.set_rng_state(state["torch"])
        cuda = state["cuda"]
        if cuda and torch.cuda.is_available():
            # one entry: this process's device; a longer list (the layout before: every visible device) is
            # indexed by the current device
            idx = 0 if len(cuda) == 1 else torch.cuda.current_device()
            if idx >= len(cuda):
                raise ValueError(f"{len(cuda)} CUDA generator states for current device {idx}")
            torch.cuda.set_rng_state(cuda[idx])
        py_version, py_state, py_gauss = state["python"]
        random.setstate((py_version, tuple(py_state), py_gauss))
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise field_error(CheckpointError, "train_state.rng", type(e).__name__,
                          "the RNG layout written by capture_rng", f"the checkpoint is foreign or damaged: {e}") from e


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), Python and NumPy."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
