"""The worker processes of ``bench_step_cost.py``: one fresh process per pod-mode phase, the warm loop, the pool.

The parent (``bench_step_cost.py``) spawns ``python benchmarks/step_cost_worker.py <worker> --state DIR``; the
worker reads the run's spec from ``DIR/spec.json``, times its components (see the parent's docstring) and prints
one JSON report line after ``MARK`` on stdout. Workers: ``setup`` (step-0 version, step 1 in-process), ``warm``
(the phase functions in one process, batch in memory), ``pool`` (``pool.execution=pool``), and one per phase.
"""

from __future__ import annotations

import time

_T0_WALL = time.time()  # the first thing a worker does: the parent's spawn -> here is interpreter start

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PHASES = ("rollout", "reward", "advantage", "train", "publish")
MARK = "@@STEPCOST "
RUN = "stepcost"
STEP = 2  # the measured step: trains from version 1 (a real optimizer state), writes version 2

from step_cost_shapes import construct_shaped, load_standin, patch_shaped, write_standin  # noqa: E402


class Clock:
    """Accumulates seconds per component; ``wrap`` times a library function wherever the phases call it."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.t: dict[str, float] = {}

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def add(self, name: str, seconds: float) -> None:
        self.t[name] = self.t.get(name, 0.0) + seconds

    def timed(self, name: str, fn, *a, **kw):
        self.sync()
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.sync()
            self.add(name, time.perf_counter() - t0)

    def wrap(self, owner, attr: str, name: str) -> None:
        orig = getattr(owner, attr)

        def wrapped(*a, **kw):
            return self.timed(name, orig, *a, **kw)

        setattr(owner, attr, wrapped)


def _instrument(clock: Clock) -> None:
    """Time the checkpoint reads and writes the phase functions do, as ``restore`` / ``write``."""
    from unirl_core.runtime import build, steps  # the phase bodies (loop.phases delegates to runtime.steps)

    clock.wrap(build, "load_policy_weights", "restore")          # rollout: the version's weights
    clock.wrap(steps, "restore_train_checkpoint", "restore")     # train: weights + optimizer state
    clock.wrap(steps, "load_version_json", "restore")            # advantage: the tracker state (extra.json)
    clock.wrap(steps, "load_manifest", "restore")                # publish: the manifest
    clock.wrap(steps, "save_train_checkpoint", "write")          # train: the new version


def _spec(state: Path) -> dict:
    return json.loads((state / "spec.json").read_text())


def _config(spec: dict):
    from unirl_core.config import load_recipe

    return load_recipe(spec["recipe"], spec["overrides"])


def _ref(path: Path):
    from unirl_core.checkpoint import CheckpointRef

    return CheckpointRef(**json.loads(path.read_text()))


def _save_ref(ref, path: Path) -> None:
    import dataclasses

    path.write_text(json.dumps(dataclasses.asdict(ref)))


# ---- the workers

def _imports(spec: dict, clock: Clock) -> None:
    try:
        clock.timed("flytekit", __import__, "flytekit")
    except ImportError:
        pass
    t0 = time.perf_counter()
    import torch

    import unirl_core.config
    import unirl_core.io
    import unirl_core.runtime.build
    import unirl_core.loop.phases  # noqa: F401

    __import__("diffusers" if spec["family"] == "diffusion" else "transformers")
    clock.add("import", time.perf_counter() - t0)
    if spec["device"] == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def _setup_worker(state: Path) -> dict:
    """Step-0 version, step 1 in-process (version 1 with a real optimizer state), version 0 dropped."""
    import logging

    t0 = time.perf_counter()

    def progress(what: str) -> None:
        print(f"  [setup] {what} at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    spec = _spec(state)
    clock = Clock(spec["device"])
    _imports(spec, clock)
    progress("imports")
    logging.getLogger("unirl.progress").disabled = True
    if spec.get("shaped"):
        from safetensors.torch import save_model

        module = construct_shaped(spec)
        progress("shaped model built")
        save_model(module, str(state / "model-init.safetensors"))
        del module
        progress("shaped weights written")
        for phase, nbytes in spec.get("standins", {}).items():
            write_standin(state / f"standin-{phase}.safetensors", int(nbytes * spec.get("standin_scale", 1.0)))
        patch_shaped(spec, state, clock)
        progress("stand-ins written")
    from unirl_core.checkpoint import CheckpointStore
    from unirl_core.loop import phases

    cfg = _config(spec)
    v0 = phases.init_run(cfg, resume_from="never")
    progress("version 0 written")
    metrics, v1 = _inprocess_step(cfg, v0, 1, Clock(spec["device"]), None)
    progress("step 1 trained and version 1 written")
    _save_ref(v1, state / "v1.json")
    CheckpointStore(cfg.checkpoint.root, cfg.name, keep_last=1).apply_retention()  # drop version 0 (disk)
    return {"setup_s": time.perf_counter() - t0, "step1_metrics": metrics}


def _inprocess_step(cfg, ckpt, step: int, clock: Clock, per_phase: dict | None, emitted: dict | None = None):
    """One step as ``run_local`` runs it: the phase functions chained in this process, batch in memory
    (``emitted``: filled with the batch each of rollout / reward / advantage returned)."""
    from unirl_core.loop import phases
    from unirl_core.loop.executors import in_process
    from unirl_core.loop.metrics import merge_shard_metrics
    from unirl_core.types import SampleBatch

    out: dict[str, dict[str, float]] = {}

    def run(name, fn, *a, **kw):
        clock.t = {}
        clock.sync()
        t0 = time.perf_counter()
        if name == "train":
            clock.timed("build", in_process().resources.trainer, cfg)  # cached after the first step
        result = fn(*a, **kw)
        clock.sync()
        total = time.perf_counter() - t0
        t = dict(clock.t)
        t["compute"] = total - sum(v for k, v in t.items() if "." not in k)
        t["total"] = total
        out[name] = t
        return result

    metrics: dict[str, float] = {}
    b, m = run("rollout", phases.rollout_phase, cfg, ckpt, step=step, shard=0, num_shards=1)
    metrics.update(merge_shard_metrics([m]))
    batch = SampleBatch.concat([b])
    kept = {"rollout": batch}
    batch, m = run("reward", phases.reward_phase, cfg, batch)
    metrics.update(m)
    kept["reward"] = batch
    batch, m = run("advantage", phases.advantage_phase, cfg, batch, ckpt)
    metrics.update(m)
    kept["advantage"] = batch
    if emitted is not None:
        emitted.update(kept)
    new, m = run("train", phases.train_phase, cfg, batch, ckpt, step=step)
    metrics.update(m)
    run("publish", phases.publish_phase, cfg, new)
    if per_phase is not None:
        per_phase.update(out)
    return metrics, new


def _worker_start(state: Path) -> tuple[dict, Clock]:
    """What every worker does first: read the spec, import (timed), silence progress lines, hook the clock."""
    import logging

    spec = _spec(state)
    clock = Clock(spec["device"])
    _imports(spec, clock)
    logging.getLogger("unirl.progress").disabled = True
    _instrument(clock)
    return spec, clock


def _warm_worker(state: Path, repeats: int) -> dict:
    """Build, warm up with step k, then time step k ``repeats`` times in this process."""
    spec, clock = _worker_start(state)
    if spec.get("shaped"):
        patch_shaped(spec, state, clock)
    cfg = _config(spec)
    v1 = _ref(state / "v1.json")
    t0 = time.perf_counter()
    first: dict = {}
    if spec.get("shaped"):
        for phase in ("rollout", "reward"):  # the pipeline's encoders / reward model, resident from now on
            load_standin(spec, state, phase, clock)
    _inprocess_step(cfg, v1, STEP, clock, first)
    warmup_s = time.perf_counter() - t0
    print(f"  [warm] warm-up step {warmup_s:.1f} s", file=sys.stderr, flush=True)
    steps, metrics = [], {}
    for k in range(repeats):
        per: dict = {}
        metrics, new = _inprocess_step(cfg, v1, STEP, clock, per)
        steps.append(per)
        print(f"  [warm] step {k + 1}/{repeats} at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return {"warmup_step_s": warmup_s, "warmup_phases": first, "steps": steps, "metrics": metrics,
            "version_bytes": _tree_bytes(Path(new.uri))}


def _phase_worker(phase: str, state: Path) -> dict:
    """One phase as a pod runs it: fresh process, build, restore, read input, run, write output."""
    spec, clock = _worker_start(state)
    from unirl_core.io import read_batch, write_batch
    from unirl_core.loop import phases
    from unirl_core.runtime import build
    from unirl_core.loop.executors import in_process

    t0 = time.perf_counter()
    if spec.get("shaped"):
        patch_shaped(spec, state, clock)
    cfg = _config(spec)
    v1 = _ref(state / "v1.json")
    if phase == "rollout":
        in_process().resources.bundle(cfg)
        build.dataset(cfg)
    elif phase == "reward":
        build.reward_service(cfg)
    elif phase == "train":
        in_process().resources.trainer(cfg)
    elif phase == "publish":
        build.store(cfg)
    load_standin(spec, state, phase, clock)
    clock.sync()
    clock.add("build", time.perf_counter() - t0)  # includes the build.* sub-components
    pods = state / "pods"
    inputs = {"reward": "rollout", "advantage": "reward", "train": "advantage"}
    batch = clock.timed("read", _read_input, read_batch, pods / f"{inputs[phase]}.arrow") if phase in inputs else None
    before = dict(clock.t)
    t1 = time.perf_counter()
    if phase == "rollout":
        out, metrics = phases.rollout_phase(cfg, v1, step=STEP, shard=0, num_shards=1)
    elif phase == "reward":
        out, metrics = phases.reward_phase(cfg, batch)
    elif phase == "advantage":
        out, metrics = phases.advantage_phase(cfg, batch, v1)
    elif phase == "train":
        out, metrics = phases.train_phase(cfg, batch, v1, step=STEP)
    else:
        out, metrics = phases.publish_phase(cfg, _ref(pods / "v2.json")), {}
    clock.sync()
    inside = sum(clock.t.get(k, 0.0) - before.get(k, 0.0) for k in ("restore", "write"))
    clock.add("compute", time.perf_counter() - t1 - inside)
    written, projected = 0, 0
    if phase in ("rollout", "reward", "advantage"):
        path = pods / f"{phase}.arrow"
        clock.timed("write", _write_hashed, write_batch, out, path)
        written = path.stat().st_size
        projected = _projection_bytes(write_batch, out, pods / f"{phase}.projection.arrow")  # untimed
    elif phase == "train":
        t2 = time.perf_counter()
        _save_ref(out, pods / "v2.json")
        clock.add("write", time.perf_counter() - t2)
        written = _tree_bytes(Path(out.uri))
    return {"phase": phase, "t": clock.t, "metrics": {k: float(v) for k, v in metrics.items()
                                                      if isinstance(v, (int, float))}, "bytes_written": written,
            "projection_bytes": projected}


def _projection_bytes(write_batch, batch, path: Path) -> int:
    """Size of the Arrow file of ``batch``'s pool projection (what a pool-mode phase emits to the store)."""
    from unirl_core.pool.projection import project

    write_batch(project(batch), path)
    return path.stat().st_size


def _pool_worker(state: Path, repeats: int) -> dict:
    """``pool.execution=pool`` in this process (a local Ray head, actors for engine / trainer / reward): the
    first step trains from version 1 (actor start, restore), then ``repeats`` chained steps k+1, k+2, ... each
    from the previous version, so the trainer and engine stay resident (the pool's steady state). Works on a
    copy of the checkpoint root (chained versions must not disturb the pods / warm rounds)."""
    spec, clock = _worker_start(state)
    from unirl_core.checkpoint import CheckpointRef
    from unirl_core.io import write_batch
    from unirl_core.pool.cluster import close_pool

    root = state / "pool-ckpt"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(state / "ckpt", root)
    shutil.rmtree(root / RUN / "step-00000002", ignore_errors=True)  # a warm / pods round's version 2
    v1 = _ref(state / "v1.json")
    ckpt = CheckpointRef(uri=str(root / RUN / Path(v1.uri).name), run=RUN, step=v1.step,
                         policy_version=v1.policy_version)
    pool_spec = dict(spec, overrides=[*spec["overrides"], f"checkpoint.root={root}", "pool.execution=pool",
                                      f"loop.total_steps={STEP + repeats + 1}"])
    cfg = _config(pool_spec)
    t0 = time.perf_counter()
    first: dict = {}
    metrics, ckpt = _inprocess_step(cfg, ckpt, STEP, clock, first)
    first_s, first_metrics = time.perf_counter() - t0, metrics
    steps, bytes_per_step = [], []
    for k in range(repeats):
        per: dict = {}
        emitted: dict = {}
        metrics, ckpt = _inprocess_step(cfg, ckpt, STEP + 1 + k, clock, per, emitted)
        steps.append(per)
        arrow = {ph: _projection_size(write_batch, b, state / f"pool-{ph}.arrow") for ph, b in emitted.items()}
        bytes_per_step.append({"arrow": arrow, "checkpoint_version": _tree_bytes(Path(ckpt.uri))})
    close_pool()
    return {"first_step_s": first_s, "first_phases": first, "metrics": first_metrics, "steps": steps,
            "bytes_per_step": bytes_per_step}


def _projection_size(write_batch, batch, path: Path) -> int:
    """Size of the Arrow file of a batch a pool-mode phase returned (already a projection)."""
    write_batch(batch, path)
    return path.stat().st_size


def _read_input(read_batch, path: Path):
    """The whole file read once (a pod downloads its input blob), then mapped by ``read_batch``."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    return read_batch(path)


def _write_hashed(write_batch, batch, path: Path) -> str:
    """Arrow IPC file + sha256 of it: what the Flyte ``HashedSampleBatch`` type does before uploading."""
    import hashlib

    write_batch(batch, path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("worker", choices=("setup", "warm", "pool", *PHASES))
    ap.add_argument("--state", required=True)
    ap.add_argument("--warm-repeats", type=int, default=1)
    args = ap.parse_args()
    state = Path(args.state)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    if args.worker == "setup":
        result = _setup_worker(state)
    elif args.worker == "warm":
        result = _warm_worker(state, args.warm_repeats)
    elif args.worker == "pool":
        result = _pool_worker(state, args.warm_repeats)
    else:
        result = _phase_worker(args.worker, state)
    result["t0_wall"] = _T0_WALL
    result["end_wall"] = time.time()
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
