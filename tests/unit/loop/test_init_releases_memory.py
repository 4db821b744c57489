"""A fresh run's step-0 model (built only to write version 0) is freed when ``init_run`` returns, not at Python's
next full collection: it holds a whole copy of the weights (3.2 GiB at qwen3-math's shape). (qwen3-math's H200 peak
turned out to be another transient: the step-1 restore's zero-gradient optimizer step, tests/unit/checkpoint.)"""

import gc
import weakref

import pytest
import torch

from unirl_core.config.recipes import load_recipe
from unirl_core.loop import phases
from unirl_core.runtime import build


@pytest.mark.parametrize("recipe", ["tiny-grpo", "tiny-flow-grpo"])
def test_init_run_frees_the_step0_model(recipe, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    built = []
    fresh_bundle = build.fresh_bundle

    def recording(cfg):
        bundle = fresh_bundle(cfg)
        module = getattr(bundle, "module", None) or bundle.transformer
        built.append([weakref.ref(p) for p in module.parameters()])
        return bundle

    monkeypatch.setattr(build, "fresh_bundle", recording)
    cfg = load_recipe(recipe, [f"checkpoint.root={tmp_path}", "report.tensorboard=false"])
    was_enabled = gc.isenabled()
    gc.disable()  # only an explicit collection may free it: the automatic one would make this test flaky
    try:
        ref = phases.init_run(cfg, resume_from="never")
        alive = [sum(r() is not None for r in refs) for refs in built]
    finally:
        if was_enabled:
            gc.enable()
    assert ref.step == 0 and len(built) == 1 and len(built[0]) > 0
    assert alive == [0], f"{alive[0]} of the step-0 model's {len(built[0])} parameters still allocated"
