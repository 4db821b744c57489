"""The CPU rehearsal of a cluster recipe: the recipe as shipped, with its models built at random init and tiny shapes.

``rehearsal_overrides(recipe, root)`` returns the ``a.b=value`` overrides that turn a cluster recipe (``sd35m-*``,
``qwen3-math``) into a run a CPU finishes in seconds a step, and nothing else changes: the same family, algorithm
and loss settings, data path, reward components (their real scorer code), tracker, advantage, checkpoint policy and
report. What it swaps:

- the model (``RANDOM_INIT``): ``stabilityai/stable-diffusion-3.5-medium`` becomes ``tiny-sd35`` (the SD3 pipeline
  classes with SD3.5-Medium's MMDiT-X block, q/k RMS norm and 16 latent channels; 2 layers, CLIP x2 + T5, tiny VAE),
  a ``Qwen/Qwen3-*`` model becomes ``tiny`` (a Qwen3-architecture causal LM, byte-level BPE); float32 on the CPU, no
  CUDA graphs. A model without a random-init stand-in is refused, naming the field;
- the shapes: 64 px images, 16 new tokens, 2 prompts x 2 samples a step, micro-batches (and the engine's forward
  batches, which the stored log-probs' slicing must match) of 2, 2 rollout shards;
- CLIP-family scorers (``pickscore``, ``hpsv2``, ``clipscore``): a random-init ``CLIPModel`` of tiny width written
  to ``<root>/rehearsal-clip`` by :func:`tiny_clip`, read with ``from_pretrained`` like the real weights;
- ``checkpoint.root``: ``root``; ``loop.total_steps``: ``steps``.

What it cannot show: the real weights' download, numerics in bf16 on a GPU, CUDA graphs, the memory a pod needs.
``python -m unirl_core.config.rehearsal <recipe> <root> [--steps N]`` prints the overrides as JSON for
``pyflyte run ... --overrides`` (docs/cluster.md, "CPU rehearsal").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from unirl_core.config.recipes import load_recipe_dict
from unirl_core.errors import ConfigError, field_error

RANDOM_INIT = {"stabilityai/stable-diffusion-3.5-medium": "tiny-sd35", "Qwen/Qwen3-": "tiny"}
"""A recipe's model (a hub id, or a prefix ending in ``-``) -> the preset of its architecture at random init."""
CLIP_SCORERS = ("pickscore", "hpsv2", "clipscore")
"""Scorers whose ``model`` / ``processor`` kwargs name a CLIP folder; the rehearsal points them at a tiny one."""
TINY_SHAPES = {"height": 64, "width": 64, "max_new_tokens": 16, "prompts_per_step": 2, "samples_per_prompt": 2,
               "micro_batch_size": 2, "rollout_shards": 2}


def byte_chars() -> list[str]:
    """The printable-byte-to-unicode table of byte-level BPE (256 characters), so every byte has a token."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def tiny_clip(path: str | Path, *, seed: int = 0) -> Path:
    """A random-init ``CLIPModel`` (2 layers, width 32, projection 16, 32 px images) and a character-level CLIP
    processor, saved as a ``from_pretrained`` folder at ``path`` (no download). Returns ``path``."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for c in byte_chars():
            vocab[c + suffix] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[])
    proc = CLIPProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32},
                                                               crop_size={"height": 32, "width": 32}), tokenizer=tok)
    torch.manual_seed(seed)
    layers = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(vocab), max_position_embeddings=32, bos_token_id=0,
                                      eos_token_id=1, pad_token_id=1, **layers),
                     vision_config=dict(image_size=32, patch_size=8, **layers), projection_dim=16)
    path = Path(path)
    CLIPModel(cfg).save_pretrained(path)
    proc.save_pretrained(path)
    return path


def _components(data: dict, clip_dir: str) -> list[dict]:
    out = []
    for comp in data.get("reward", {}).get("components", []):
        comp = dict(comp)
        if comp.get("name") in CLIP_SCORERS:
            comp["kwargs"] = {**comp.get("kwargs", {}), "model": clip_dir, "processor": clip_dir, "device": "cpu",
                              "dtype": "float32"}
        out.append(comp)
    return out


def _stand_in(field: str, model: str) -> str:
    for key, preset in RANDOM_INIT.items():
        if model == key or (key.endswith("-") and model.startswith(key)):
            return preset
    raise field_error(ConfigError, field, model, f"a model with a random-init stand-in ({sorted(RANDOM_INIT)})",
                      "add its architecture's tiny preset to unirl_core.config.rehearsal.RANDOM_INIT")


def rehearsal_overrides(recipe: str, root: str, *, steps: int = 2, write_clip: bool = True) -> list[str]:
    """The overrides of ``recipe``'s CPU rehearsal (module docstring), storage under the local folder ``root``;
    ``write_clip`` writes the tiny CLIP folder its CLIP scorers read (``<root>/rehearsal-clip``)."""
    data = load_recipe_dict(recipe)
    family = data.get("family")
    s = TINY_SHAPES
    out = [f"checkpoint.root={root}", f"loop.total_steps={steps}", f"loop.rollout_shards={s['rollout_shards']}",
           f"data.prompts_per_step={s['prompts_per_step']}", f"data.samples_per_prompt={s['samples_per_prompt']}",
           f"train.micro_batch_size={s['micro_batch_size']}"]
    if family == "diffusion":
        source = _stand_in("diffusion.model.source", data["diffusion"]["model"]["source"])
        out += [f"diffusion.model.source={source}", "diffusion.model.dtype=float32", "diffusion.model.device=cpu",
                "diffusion.model.cuda_graphs=never", f"diffusion.engine.forward_batch_size={s['micro_batch_size']}",
                f"diffusion.sampling.height={s['height']}",
                f"diffusion.sampling.width={s['width']}"]
    elif family == "lm":
        n = s["max_new_tokens"]
        model = _stand_in("lm.model.model", data["lm"]["model"]["model"])
        out += [f"lm.model.model={model}", "lm.model.tokenizer=null", "lm.model.dtype=float32", "lm.model.device=cpu",
                f"lm.engine.forward_batch_size={s['micro_batch_size']}", f"lm.sampling.max_new_tokens={n}",
                f"lm.algorithm.max_response_tokens={n}"]
    else:
        raise field_error(ConfigError, f"{recipe}: family", family, "'diffusion' or 'lm'",
                          "rehearse an RL recipe (a composed or SFT recipe has no rehearsal)")
    comps = data.get("reward", {}).get("components", [])
    if any(c.get("name") in CLIP_SCORERS for c in comps):
        clip_dir = str(Path(root) / "rehearsal-clip")
        if write_clip and not (Path(clip_dir) / "config.json").exists():
            tiny_clip(clip_dir)
        out.append(f"reward.components={json.dumps(_components(data, clip_dir))}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unirl_core.config.rehearsal",
                                 description="Print the overrides of a recipe's CPU rehearsal as JSON.")
    ap.add_argument("recipe", help="a shipped recipe name or a YAML path")
    ap.add_argument("root", help="a local folder for the run's checkpoints (and the tiny CLIP folder)")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    print(json.dumps(rehearsal_overrides(args.recipe, args.root, steps=args.steps)))


if __name__ == "__main__":
    main()
