"""NoiseRecipe sampler: bit-identical initial latents in any process and on any device.

Seeds: ``group_seed = blake2b(f"{base_seed}:{group_id}")`` (64 bits, masked to 63). Each group gets
a CPU ``torch.Generator`` with that seed; sibling ``k`` (the k-th sample of the group in batch
order, counting from 0) takes the ``k``-th draw of shape ``[C, H, W]`` in fp32. A sibling's noise
therefore depends only on (base seed, group id, k, shape): not on the group size, the batch order
of other groups, or ``forward_batch_size``. With ``same_noise_per_group`` every sibling takes draw 0.

The per-step SDE noise uses a second stream per sample (``.../sde/k``) on the engine's device:
the stored trajectory, not the SDE noise, is what replay needs, so that stream only has to be
reproducible on the same device type.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from unirl_core.types.noise import NoiseRecipe


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a stable hash of the parts (independent of PYTHONHASHSEED and platform)."""
    text = ":".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)


def group_seed(base_seed: int, group_id: str) -> int:
    """Per-group seed of the initial noise."""
    return stable_seed(base_seed, group_id)


def sibling_indices(group_ids: Sequence[str]) -> list[int]:
    """Index of each sample within its group, in batch order (``["a", "b", "a"] -> [0, 0, 1]``)."""
    seen: dict[str, int] = {}
    out = []
    for g in group_ids:
        out.append(seen.get(g, 0))
        seen[g] = out[-1] + 1
    return out


def initial_noise(recipe: NoiseRecipe, group_ids: Sequence[str], shape: Sequence[int],
                  sibling_index: Sequence[int] | None = None) -> Tensor:
    """x_T for samples of the given groups: ``[N, *shape]`` fp32 on CPU.

    ``sibling_index`` defaults to ``sibling_indices(group_ids)``; pass it explicitly when the
    samples are a slice of a larger batch.
    """
    idx = list(sibling_index) if sibling_index is not None else sibling_indices(group_ids)
    out = torch.empty((len(group_ids), *shape), dtype=torch.float32)
    cache: dict[str, tuple[torch.Generator, list[Tensor]]] = {}
    for row, (gid, k) in enumerate(zip(group_ids, idx)):
        want = 0 if recipe.same_noise_per_group else k
        gen, draws = cache.setdefault(gid, (torch.Generator(device="cpu").manual_seed(group_seed(recipe.base_seed, gid)), []))
        while len(draws) <= want:
            draws.append(torch.randn(tuple(shape), generator=gen, dtype=torch.float32))
        out[row] = draws[want]
    return out


def sde_noise_generators(recipe: NoiseRecipe, group_ids: Sequence[str], sibling_index: Sequence[int],
                         device: torch.device | str) -> list[torch.Generator]:
    """One generator per sample for the per-step SDE noise (siblings always differ here)."""
    return [torch.Generator(device=device).manual_seed(stable_seed(recipe.base_seed, gid, "sde", k))
            for gid, k in zip(group_ids, sibling_index)]
