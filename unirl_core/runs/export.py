"""Export a run's version as a folder other libraries load: a peft adapter, a diffusers pipeline or a transformers
model (``unirl_core.models.export`` writes the formats).

``python -m unirl_core.runs.export <version or run URI> <out URI> [--format peft|diffusers|transformers]
[--ema] [--device cpu]``

The version's own ``config.json`` says how to build the model (the run's recipe, its plugins imported); its
weights are loaded into a fresh bundle and written to ``<out>`` through fsspec, ``export.json`` (which version,
which format) last: a folder without it is incomplete. A run folder (``<root>/<run>``) exports its latest version.
SFT's ``export_model`` writes its folders with :func:`write_export` too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import posixpath
import tempfile
from pathlib import Path

import fsspec

from unirl_core.checkpoint import CheckpointRef, CheckpointStore, load_manifest, load_version_json, load_weights
from unirl_core.checkpoint.manifest import MANIFEST
from unirl_core.config.loader import from_dict, to_dict
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, field_error
from unirl_core.models.export import EXPORT_FORMATS, EXPORT_MARKER, default_format, write_export
from unirl_core.plugins import import_plugins
from unirl_core.runtime.build import apply_policy_weights, fresh_bundle

log = logging.getLogger(__name__)

def version_ref(uri: str, storage_options: dict | None = None) -> CheckpointRef:
    """The version at ``uri``, or the latest version of the run folder at ``uri``."""
    uri = uri.rstrip("/")
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if fs.exists(posixpath.join(path, MANIFEST)):
        probe = CheckpointRef(uri=uri, run=posixpath.basename(posixpath.dirname(uri)), step=0, policy_version=0)
        m = load_manifest(probe, storage_options=storage_options)  # the version's own step and policy version
        return CheckpointRef(uri=uri, run=m.run, step=m.step, policy_version=m.policy_version)
    root, run = posixpath.dirname(uri), posixpath.basename(uri)
    ref = CheckpointStore(root, run, storage_options=storage_options).latest()
    if ref is None:
        raise field_error(CheckpointError, "export source", uri, "a version folder (with manifest.json) or a run "
                          "folder with a published version", "pass <root>/<run>/step-XXXXXXXX or <root>/<run>")
    return ref


def version_config(ref: CheckpointRef, storage_options: dict | None = None) -> RunConfig:
    """The run config a version was trained with (its ``config.json``; its plugins imported first)."""
    data = load_version_json(ref, "config.json", storage_options=storage_options)
    if not isinstance(data, dict):
        raise field_error(CheckpointError, "export source", ref.uri, "a version with its run's config.json",
                          "export a version written by an RL run (run_local / the Flyte loop)")
    if data.get("plugins"):
        import_plugins(data["plugins"])
    return from_dict(RunConfig, data, f"{ref.uri}/config.json")


def _on_device(cfg: RunConfig, device: str | None) -> RunConfig:
    if device is None:
        return cfg
    model = dataclasses.replace(cfg.section.model, device=device)
    section = dataclasses.replace(cfg.section, model=model)
    return dataclasses.replace(cfg, **{cfg.family: section})


def base_model_name(cfg: RunConfig) -> str:
    """What the run started from (``base_model_name_or_path`` of a peft adapter)."""
    m = cfg.section.model
    return m.source if cfg.family == "diffusion" else m.model


def export_version(source: str, out: str, fmt: str | None = None, *, ema: bool = False, device: str | None = None,
                   storage_options: dict | None = None) -> str:
    """Write the version at ``source`` (or a run folder's latest) to ``out`` in format ``fmt`` (None: ``peft`` for
    a LoRA run, else ``diffusers`` / ``transformers``); ``ema`` exports the EMA weights. Returns ``out``."""
    ref = version_ref(source, storage_options)
    cfg = _on_device(version_config(ref, storage_options), device)
    bundle = fresh_bundle(cfg)
    apply_policy_weights(bundle, load_weights(ref, storage_options=storage_options, ema=ema), where=ref.uri)
    fmt = fmt or default_format(bundle)
    marker = {"weights": "ema" if ema else "model", "run": cfg.name, "step": ref.step,
              "policy_version": ref.policy_version, "version_uri": ref.uri, "family": cfg.family,
              "model": to_dict(cfg.section.model)}
    write_export(bundle, fmt, out, marker, base_model=base_model_name(cfg), storage_options=storage_options)
    log.info("exported %s as %s to %s", ref.uri, fmt, out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unirl_core.runs.export",
                                 description="Export a run's version as a peft / diffusers / transformers folder.")
    ap.add_argument("source", help="a version folder <root>/<run>/step-XXXXXXXX, or a run folder (its latest)")
    ap.add_argument("out", help="the folder to write (local path or fsspec URI)")
    ap.add_argument("--format", choices=sorted(EXPORT_FORMATS), default=None,
                    help="default: peft for a LoRA run, diffusers / transformers for a full fine-tune")
    ap.add_argument("--ema", action="store_true", help="export the version's EMA weights")
    ap.add_argument("--device", default="cpu", help="where the model is built for the export (default cpu)")
    ap.add_argument("--storage-options", default="{}", help="fsspec options as JSON (both URIs)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = export_version(args.source, args.out, args.format, ema=args.ema, device=args.device,
                         storage_options=json.loads(args.storage_options))
    print(out)


if __name__ == "__main__":
    main()
