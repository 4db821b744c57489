"""Runs inside a virtual environment built from one role ImageSpec's packages (``test_role_images.py``): imports
the modules holding that role's tasks the way its pod does (``_F_IMG_ID`` set to the spec's id, so the role's
guarded imports run and the other roles' are skipped), then one tiny step of the role's work.

Usage: ``python role_image_check.py <rollout|reward|train> <scratch dir> <module>...`` (the modules holding the role's
tasks) with the project root on PYTHONPATH (a
pod gets the source the same way: fast registration, not the image). Prints ``ok <role>`` last.
"""

from __future__ import annotations

import importlib
import io
import os
import sys
from pathlib import Path


def _import_role_modules(role: str, modules: list[str]) -> None:
    from flytekit.image_spec.image_spec import _F_IMG_ID

    import images.specs as specs

    spec = {"rollout": specs.rollout_image, "reward": specs.reward_image, "train": specs.train_image}[role]
    os.environ[_F_IMG_ID] = spec.id  # what flytekit bakes into the built image
    for name in modules:
        importlib.import_module(name)
    if not spec.is_container():
        raise SystemExit(f"{spec.name}: is_container() is False inside its own image")
    # pool mode: every role's phase tasks reach the run's Ray pool as Ray clients
    importlib.import_module("unirl_core.pool.cluster")
    importlib.import_module("ray.util.client")


def _tiny_run(scratch: Path, recipe: str, *extra: str) -> None:
    from unirl_core.config import load_recipe
    from unirl_core.loop.local import run_local

    cfg = load_recipe(recipe, [f"checkpoint.root={scratch / 'runs'}", "loop.total_steps=1", *extra])
    metrics = run_local(cfg, progress=False)
    if len(metrics) != 1:
        raise SystemExit(f"{recipe}: expected one step's metrics, got {len(metrics)}")


def _rollout(scratch: Path) -> None:
    # the model stack of both families (diffusers + peft LoRA, transformers) and the checkpoint formats
    _tiny_run(scratch, "tiny-flow-grpo")
    _tiny_run(scratch, "tiny-grpo")


def _reward(scratch: Path) -> None:
    """The cluster recipes' scorers: OCR (rapidocr on onnxruntime), math-verify and the format term, PickScore's
    CLIP code (random init, tiny shapes), and the reward server's app (fastapi, served through httpx)."""
    from PIL import Image, ImageDraw

    from unirl_core.config import load_recipe
    from unirl_core.config.rehearsal import tiny_clip
    from unirl_core.reward.scorers.base import build_scorer
    from unirl_core.reward.scorers.base import ScoreItem

    img = Image.new("RGB", (256, 96), "white")
    ImageDraw.Draw(img).text((20, 30), "HELLO", fill="black")
    png = io.BytesIO()
    img.save(png, format="PNG")
    item = ScoreItem(prompt='a sign that says "HELLO"', media=png.getvalue())
    ocr = build_scorer("ocr", num_threads=1)([item])
    math_cfg = load_recipe("qwen3-math").reward.components
    text = ScoreItem(prompt="1+1?", text="so \\boxed{2}", targets={"answer": "2"})
    text_scores = [build_scorer(c.name, **c.kwargs)([text])[0] for c in math_cfg]
    if text_scores != [1.0, 1.0]:
        raise SystemExit(f"math / format scorers on a right boxed answer: {text_scores}, expected [1.0, 1.0]")
    clip_dir = tiny_clip(scratch / "clip")
    pick = build_scorer("pickscore", model=str(clip_dir), processor=str(clip_dir), divisor=26.0)([item])
    print("reward scores: ocr", ocr, "pickscore", pick)

    import uvicorn  # noqa: F401  (what `python -m unirl_core.reward.server` serves with)
    from fastapi.testclient import TestClient  # httpx underneath

    from unirl_core.reward.server import ServerConfig, create_app

    with TestClient(create_app(ServerConfig(token="t"))) as client:
        health = client.get("/health")
    if health.status_code != 200:
        raise SystemExit(f"reward server /health: {health.status_code} {health.text}")


def _train(scratch: Path) -> None:
    # train + publish + report with both trackers (the report task's sinks), offline
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow >= 3.7 refuses a file: store without it
    _tiny_run(scratch, "tiny-flow-grpo", f"report.wandb={{project: image-check, dir: '{scratch / 'wandb'}'}}",
              f"report.mlflow={{tracking_uri: '{(scratch / 'mlruns').as_uri()}'}}")
    import flytekitplugins.kfpytorch  # noqa: F401  (the train task's PyTorch-Elastic plugin)


def main() -> None:
    role, scratch, modules = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    _import_role_modules(role, modules)
    {"rollout": _rollout, "reward": _reward, "train": _train}[role](scratch)
    print(f"ok {role}")


if __name__ == "__main__":
    main()
