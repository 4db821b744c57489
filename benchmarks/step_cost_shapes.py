"""GPU presets of bench_step_cost.py: shaped random-init models loaded from a local safetensors file, and
same-size stand-ins for what a pod loads besides them (SD3.5-M's text encoders + VAE, PickScore).

No hub is reachable, so a worker replaces ``build.fresh_bundle``: it constructs the model of the preset's
shape (random init, seed 0; timed as ``build.construct``) and loads the same weights from the safetensors file
setup wrote (timed as ``build.load``, the part that stands in for ``from_pretrained``).
"""

from __future__ import annotations

from pathlib import Path

# Sizes of the SD3.5-Medium components a rollout pod loads besides the transformer (the hub repo's fp16/bf16
# safetensors: T5-XXL encoder 9.52 GB, CLIP-G 1.39 GB, CLIP-L 0.25 GB, VAE 0.17 GB), and of PickScore's
# CLIP-ViT-H-14 (0.99 B params in bf16) for the reward pod.
SD35M_ENCODERS_BYTES = int(11.33e9)
PICKSCORE_BYTES = int(1.97e9)


def construct_shaped(spec: dict):
    """The model of the preset's shape on the device, random init with a fixed seed."""
    import torch

    device, layers = spec["device"], spec.get("layers")
    torch.manual_seed(0)
    if spec["shaped"] == "sd35m":
        from bench_diffusion_rollout import SD35M
        from diffusers import SD3Transformer2DModel

        shape = dict(SD35M)
        if layers:
            shape.update(num_layers=layers, dual_attention_layers=tuple(range(min(13, layers))))
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # as bench_diffusion_rollout.build: init straight in bf16
        try:
            with torch.device(device):
                return SD3Transformer2DModel(**shape)
        finally:
            torch.set_default_dtype(prev)
    from bench_ar_rollout import QWEN3_06B
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(QWEN3_06B)
    if layers:
        shape.update(num_hidden_layers=layers)
    cfg = Qwen3Config(**shape, pad_token_id=151_643, eos_token_id=151_645, bos_token_id=151_643)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def _fake_encode(bundle, prompts):
    """Seeded random conditions of SD3.5's shapes (CLIP 77 + T5 256 tokens x 4096, pooled 2048) per prompt."""
    import zlib

    import torch

    out = []
    for p in prompts:
        g = torch.Generator().manual_seed(zlib.crc32(p.encode()))
        out.append({"prompt_embeds": torch.randn(333, 4096, generator=g).to(bundle.device, bundle.dtype),
                    "pooled_prompt_embeds": torch.randn(2048, generator=g).to(bundle.device, bundle.dtype)})
    return out


def _fake_decode_png(bundle, latents):
    """A 512 px PNG per latent (3 latent channels upsampled x8) in place of the VAE decode."""
    import io

    import torch
    from PIL import Image

    img = torch.nn.functional.interpolate(latents[:, :3].float(), scale_factor=bundle.vae_scale_factor)
    arr = ((img.clamp(-2, 2) / 4 + 0.5) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    out = []
    for a in arr:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def patch_shaped(spec: dict, state: Path, clock) -> None:
    """Replace ``build.fresh_bundle`` by construct + safetensors load of the preset's weights."""
    import types

    from safetensors.torch import load_model

    from unirl_core.runtime import build

    weights = state / "model-init.safetensors"

    def fresh_bundle(cfg):
        module = clock.timed("build.construct", construct_shaped, spec)
        clock.timed("build.load", load_model, module, str(weights), device=spec["device"])
        if spec["shaped"] == "sd35m":
            from unirl_core.models.diffusion import DiffusionBundle

            bundle = DiffusionBundle.from_transformer(module, family="sd3", config=cfg.diffusion.model)
            bundle.encode_text = types.MethodType(_fake_encode, bundle)
            bundle.decode_png = types.MethodType(_fake_decode_png, bundle)
            return bundle
        from bench_ar_rollout import _word_tokenizer

        from unirl_core.models.lm import LMBundle

        tok = clock.timed("build.tokenizer", _word_tokenizer, module.config.vocab_size, 151_645, 151_643)
        module.generation_config.eos_token_id = 151_645
        module.generation_config.pad_token_id = 151_643
        return LMBundle(module, tok, config=cfg.lm.model)

    build.fresh_bundle = fresh_bundle


_STANDIN_TENSORS: list = []  # stand-in components stay resident, as a pipeline's encoders would


def load_standin(spec: dict, state: Path, phase: str, clock) -> None:
    path = state / f"standin-{phase}.safetensors"
    if phase in spec.get("standins", {}) and path.exists():
        from safetensors.torch import load_file

        _STANDIN_TENSORS.append(clock.timed(f"build.standin_{phase}", load_file, str(path), device=spec["device"]))


def write_standin(path: Path, nbytes: int) -> None:
    import torch
    from safetensors.torch import save_file

    chunk = 1 << 30
    tensors, left, i = {}, nbytes, 0
    while left > 0:
        n = min(chunk, left)
        tensors[f"blob_{i:03d}"] = torch.zeros(n, dtype=torch.uint8)
        left, i = left - n, i + 1
    save_file(tensors, str(path))


class _NoClock:
    def timed(self, _name, fn, *a, **kw):
        return fn(*a, **kw)


SPEC_ENV = "UNIRL_SHAPED_STATE"
"""The state folder (``spec.json`` + ``model-init.safetensors``) a pool actor's ``worker_hook`` patches from."""


def worker_hook() -> None:
    """``pool.worker_setup_hook``: the shaped builder in a Ray actor process (it does not see the driver's patch)."""
    import json
    import os

    state = Path(os.environ[SPEC_ENV])
    patch_shaped(json.loads((state / "spec.json").read_text()), state, _NoClock())


def step_model_flops(spec: dict, cfg) -> float | None:
    """Model FLOPs of one loop step of a shaped preset (the numerator of its MFU; ``common``'s convention), None for
    the tiny presets. ``cfg``: the run's RunConfig.

    LM (GRPO): generation of every row (prompt: the toy template's words, one token each under the word tokenizer;
    response: ``max_new_tokens``, as a random-init 151k vocabulary almost never samples EOS) + one forward and
    backward of every row (+ a reference forward with a KL). Diffusion (Flow-GRPO): one transformer row counted on the
    meta device (no GPU time; backward with the base frozen for LoRA), times the rows: the rollout's CFG forwards on
    every step, the trained steps' forward + backward (2B rows when CFG is on: the uncond half's gradient is cut after
    the joint forward), and the KL reference forward per trained step."""
    import math

    from common import lm_generate_flops, lm_replay_flops

    if not spec.get("shaped"):
        return None
    rows = cfg.data.prompts_per_step * cfg.data.samples_per_prompt
    if spec["shaped"] != "sd35m":
        lm = cfg.lm
        if cfg.data.source != "toy_arithmetic":
            return None
        p = len(cfg.data.sections["toy"].template.format(a=0, b=0).split())
        r = lm.sampling.max_new_tokens
        model_cfg = construct_shaped(dict(spec, device="meta")).config
        flops = lm_generate_flops(model_cfg, rows, p, r)
        flops += lm_replay_flops(model_cfg, rows, p, r, backward="lora" if lm.model.finetune == "lora" else "full")
        if getattr(lm.algorithm, "beta", 0.0) > 0:
            flops += lm_replay_flops(model_cfg, rows, p, r, backward=None)
        return flops
    fwd, train = _sd35m_row_flops(spec, cfg)
    d = cfg.diffusion
    cfg_rows = 2 if d.sampling.guidance_scale > 1 else 1
    steps = d.sampling.num_steps
    trained = math.ceil(d.algorithm.timestep_fraction * (d.sampling.sde_window_size or steps))
    kl = trained * fwd if getattr(d.algorithm, "kl_beta", 0.0) > 0 else 0
    return rows * cfg_rows * (steps * fwd + trained * train + kl)


def _sd35m_row_flops(spec: dict, cfg) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of one row of the SD3.5-M-shaped transformer at the run's size, on meta."""
    import torch

    from common import count_flops

    model = construct_shaped(dict(spec, device="meta"))
    s = cfg.diffusion.sampling
    bf16 = dict(device="meta", dtype=torch.bfloat16)
    x = torch.zeros(1, model.config.in_channels, s.height // 8, s.width // 8, **bf16)
    kw = dict(encoder_hidden_states=torch.zeros(1, 333, 4096, **bf16), pooled_projections=torch.zeros(1, 2048, **bf16),
              timestep=torch.zeros(1, device="meta"), return_dict=False)
    with torch.no_grad():
        fwd = count_flops(lambda: model(hidden_states=x, **kw))
    lora = cfg.diffusion.model.finetune == "lora"
    model.requires_grad_(not lora)
    # LoRA: the adapters in the first block make every activation after them need a gradient
    x.requires_grad_(lora)
    return fwd, count_flops(lambda: model(hidden_states=x, **kw)[0].float().sum().backward())
