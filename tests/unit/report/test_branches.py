"""Sibling branches in the run report: a parent and its forks side by side from the fork point (chart per metric,
table of means after the fork), found from the fork's lineage and the parent's pins."""

from __future__ import annotations

import re

import torch

from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local
from unirl_core.report.branches import branches_html, family
from unirl_core.report.run_report import RunReport

torch.set_num_threads(1)

SMALL = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
         "lm.engine.forward_batch_size=8", "report.tensorboard=false", "checkpoint.keep_every=1"]


def _cfg(root, steps: int, *extra: str):
    return load_recipe("tiny-grpo", [*SMALL, f"checkpoint.root={root}", f"loop.total_steps={steps}", *extra])


def _run(root, *extra: str) -> str:
    """A run, its steps' metrics recorded in its run report as the grpo workflow's report task records them."""
    cfg = _cfg(root, 4, *extra)
    report = RunReport(f"{root}/{cfg.name}")
    for h in run_local(cfg, progress=False):
        report.record_step(int(h["step"]), metrics={k: v for k, v in h.items() if k != "step"}, session="s")
    return cfg.name


def test_forks_of_one_parent_are_shown_side_by_side(tmp_path):
    _run(tmp_path)
    assert family(str(tmp_path), "tiny-grpo") is None and branches_html(str(tmp_path), "tiny-grpo") == ""
    _run(tmp_path, "name=neg", "checkpoint.fork_from=tiny-grpo@2",
         'reward.components=[{"name": "toy_arithmetic", "weight": -1.0}]')
    _run(tmp_path, "name=fast", "checkpoint.fork_from=tiny-grpo@1", "train.lr=0.01")
    parent, branches = family(str(tmp_path), "neg")
    assert parent == "tiny-grpo" and [(b.run, b.fork_step) for b in branches] == [
        ("tiny-grpo", None), ("fast", 1), ("neg", 2)]
    assert family(str(tmp_path), "tiny-grpo")[1] == branches  # the parent's report shows the same family
    page = branches_html(str(tmp_path), "neg")
    assert "branches of tiny-grpo" in page and "from the earliest fork point (step 1)" in page
    charts = re.findall(r'data-metric="([^"]+)"', page)
    assert charts == ["reward by branch", "ratio by branch"]  # tiny-grpo has no eval section and beta 0 (no KL)
    rows = re.findall(r"<tr[^>]*><td>([^<]+)</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>", page)
    assert [r[:3] for r in rows] == [("tiny-grpo", "", "4"), ("fast", "1", "4"), ("neg", "2", "4")]
    assert float(rows[2][3]) <= 0  # the flipped reward's mean after its fork point
    # the run report renders it: the fork's index has the section, its own row in bold
    RunReport(str(tmp_path / "neg")).render(title="neg")
    index = (tmp_path / "neg" / "report" / "index.html").read_text()
    assert "branches of tiny-grpo" in index and "<tr style='font-weight:bold'><td>neg</td>" in index
