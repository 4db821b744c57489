"""CheckpointStore: versioned, crash-safe checkpoints over fsspec (a local directory or ``s3://``).

Layout ``<root>/<run>/step-XXXXXXXX/{model.safetensors, ema.safetensors, train_state.pt, config.json,
extra.json, manifest.json}`` plus ``<root>/<run>/LATEST``. A version exists only once its manifest
(written last) parses; the pointer is replaced atomically after the manifest (local: temp file +
``os.replace``; S3: one PUT of a small object).
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
from dataclasses import asdict, dataclass, is_dataclass

import fsspec
import torch
from torch import Tensor

from unirl_core.checkpoint import tensorfile
from unirl_core.checkpoint.delta import Base, FullVersions, VersionEncoding, WeightsMemory, apply_delta
from unirl_core.checkpoint.fsio import FORKS, OWNER_RUN, Folder, Piece
from unirl_core.checkpoint.manifest import MANIFEST, Manifest
from unirl_core.checkpoint.ref import CheckpointRef, parse_step_dirname, step_dirname
from unirl_core.errors import CheckpointError, ConfigError, field_error

log = logging.getLogger(__name__)

LATEST = "LATEST"
HISTORY = "history.json"
WEIGHTS, EMA, TRAIN_STATE, CONFIG, EXTRA = "model.safetensors", "ema.safetensors", "train_state.pt", \
    "config.json", "extra.json"


@dataclass(kw_only=True, eq=False)
class LoadedCheckpoint:
    """Everything one version holds, verified against its manifest."""

    ref: CheckpointRef
    manifest: Manifest
    weights: dict[str, Tensor]
    ema_weights: dict[str, Tensor] | None
    train_state: dict[str, object] | None
    config: dict[str, object] | None
    extra: dict[str, object]


def _to_json(obj: object, what: str) -> bytes:
    if is_dataclass(obj) and not isinstance(obj, type):
        obj = asdict(obj)
    try:
        return json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise field_error(ConfigError, what, type(obj).__name__, "JSON-serialisable data (dicts, lists, numbers, "
                          "strings) or a dataclass of them", f"convert the offending value ({e})") from e


class CheckpointStore:
    """Versions of one run under a root URL; one writer (rank 0) per run, any number of readers."""

    def __init__(self, root: str, run: str, *, keep_last: int = 3, keep_every: int | None = None,
                 storage_options: dict[str, object] | None = None, encoding: VersionEncoding | None = None) -> None:
        if not run or "/" in run or run in (".", ".."):
            raise field_error(ConfigError, "checkpoint.run", run, "a non-empty name without '/'",
                              "use the run name, e.g. 'tiny-flow-grpo-0'")
        if not (isinstance(keep_last, int) and keep_last >= 1):
            raise field_error(ConfigError, "checkpoint.keep_last", keep_last, "an integer >= 1",
                              "keep at least the newest version")
        if keep_every is not None and not (isinstance(keep_every, int) and keep_every >= 1):
            raise field_error(ConfigError, "checkpoint.keep_every", keep_every, "an integer >= 1 or None",
                              "e.g. 100 keeps every 100th step forever")
        self.storage_options = dict(storage_options or {})
        fs, path = fsspec.core.url_to_fs(root, **self.storage_options)
        self.run, self.keep_last, self.keep_every = run, keep_last, keep_every
        self.encoding: VersionEncoding = encoding or FullVersions()
        self._run = Folder(fs, posixpath.join(path.rstrip("/"), run))

    @property
    def uri(self) -> str:
        return self._run.uri()

    def _version(self, step: int) -> Folder:
        return Folder(self._run.fs, self._run.join(step_dirname(step)))

    def ref_for(self, step: int, policy_version: int) -> CheckpointRef:
        """The ref version ``step`` has once saved (what ``save`` returns), before it is written."""
        return CheckpointRef(uri=self._version(step).uri(), run=self.run, step=step, policy_version=policy_version)

    # ------------------------------------------------------------------------------------------ write

    def save(self, step: int, *, weights: dict[str, Tensor], policy_version: int,
             ema_weights: dict[str, Tensor] | None = None, train_state: dict[str, object] | None = None,
             config: object | None = None, extra: dict[str, object] | None = None,
             meta: dict[str, str] | None = None, publish: bool = True, overwrite: bool = False,
             memory: WeightsMemory | None = None) -> CheckpointRef:
        """Write version ``step``: every payload file, then ``manifest.json``; then (``publish``) the pointer
        and retention. A crash before the manifest leaves an invisible partial folder that the next save of
        that step clears.

        ``memory``: the writer's copy of the last version it wrote (``WeightsMemory``); the store's ``encoding``
        may write the weights as a delta against it (``checkpoint.delta``) and leaves this version in it."""
        payload = self._payload(weights, ema_weights, train_state, config, extra)  # validates before deleting
        base = self._base(memory, step)
        if memory is not None:
            memory.version = None  # its buffers change while this version is written
        encoded = self.encoding.encode(_checked(weights, "weights"), full_state=train_state is not None,
                                       memory=memory, base=base, weights_file=WEIGHTS)
        payload = {encoded.name: encoded.pieces, **{k: v for k, v in payload.items() if k != WEIGHTS}}
        folder = self._version(step)
        if self._read_manifest(folder) is not None:
            if not overwrite:
                raise field_error(CheckpointError, folder.uri(), "exists", "a step without a published version",
                                  "versions are immutable; save under a new step or pass overwrite=True")
            folder.fs.rm_file(folder.join(MANIFEST))  # invisible first, then rewritten
        if folder.fs.exists(folder.path):
            folder.fs.rm(folder.path, recursive=True)
        files = {}
        for name, pieces in payload.items():
            digest, size = folder.write_pieces(name, pieces, sync=False)
            files[name] = {"sha256": digest, "bytes": size}
        folder.sync(list(files))  # every payload file is durable before the manifest that names it
        digest, delta = encoded.record(files[encoded.name]["sha256"])
        manifest = Manifest(run=self.run, step=step, policy_version=policy_version, files=files,
                            meta=dict(meta or {}), delta=delta)
        folder.write(MANIFEST, manifest.to_json(), atomic=True)
        if memory is not None and encoded.keeps:
            memory.version = (self.uri, step, digest, tuple(manifest.chain))
        ref = self.ref_for(step, policy_version)
        log.info("saved checkpoint %s (%.1f MB)", ref.uri, sum(f["bytes"] for f in files.values()) / 1e6)
        if publish:
            self.publish(ref)
        return ref

    def save_reference(self, source: CheckpointRef, *, config: object | None, extra: dict[str, object],
                       publish: bool = True) -> CheckpointRef:
        """Start this run (a fork) at ``source``, a complete version of another run under the same root, without
        copying it: version ``source.step`` of this run gets its own ``config.json`` and ``extra.json`` and a manifest
        whose other entries (weights, EMA, train state) name the run that holds their bytes (``fsio.OWNER_RUN``; a
        version that is itself a reference passes its owner on, so forks of forks point at the bytes' one owner).
        The owner keeps that version from then on: a pin ``<owner>/forks/<this run>.json`` (its retention reads it;
        ``source.run`` gets one too); this run's retention deletes only this run's folder. Two forks of one parent share its files."""
        src_folder, src = _open_version(source, self.storage_options)
        if posixpath.dirname(posixpath.dirname(src_folder.path)) != posixpath.dirname(self._run.path):
            raise field_error(CheckpointError, "checkpoint.fork_from", source.uri, f"a version under this run's "
                              f"root {posixpath.dirname(self._run.uri())}", "fork a run of the same checkpoint.root")
        published = CheckpointStore(posixpath.dirname(self._run.uri()), source.run,
                                    storage_options=self.storage_options)._pointer_step()
        if published is None or source.step > published:
            # a version past the published one is an interrupted step's leftover: the parent's resume replaces it
            raise field_error(CheckpointError, "checkpoint.fork_from", source.uri, f"a published version of run "
                              f"{source.run!r} (its published step is {published})", "fork a step at or before the "
                              "published one, or let the parent publish this step first")
        if src.delta is not None:
            raise field_error(CheckpointError, "checkpoint.fork_from", source.uri, "a version with its weights in "
                              "full", "fork a version that holds the full state (its weights are never a delta)")
        own = {CONFIG, EXTRA}
        files = {name: {**entry, OWNER_RUN: entry.get(OWNER_RUN, source.run)}
                 for name, entry in src.files.items() if name not in own}
        owners = sorted({str(e[OWNER_RUN]) for e in files.values()})
        # pinned before this version exists: the owner's retention keeps it from now on; the parent named (when it
        # is a fork whose start version this is) is pinned too, so each run's pins list all of its forks
        for owner in sorted({*owners, source.run}):
            pin = Folder(self._run.fs, posixpath.join(posixpath.dirname(self._run.path), owner, FORKS))
            pin.write(f"{self.run}.json", _to_json({"run": self.run, "step": source.step, "from": source.uri},
                                                     "fork pin"), atomic=True)
        if _open_version(source, self.storage_options)[1].files != src.files:
            raise field_error(CheckpointError, "checkpoint.fork_from", source.uri, "a version that stays while it "
                              "is forked", "the parent's retention replaced it meanwhile; fork again")
        folder = self._version(source.step)
        if folder.fs.exists(folder.path):
            if self._read_manifest(folder) is not None:
                raise field_error(CheckpointError, folder.uri(), "exists", "an empty fork",
                                  "a fork starts an empty run; pick another name")
            folder.fs.rm(folder.path, recursive=True)
        payload = {EXTRA: [_to_json(extra, "extra")]}
        if config is not None:
            payload[CONFIG] = [_to_json(config, "config")]
        for name, pieces in payload.items():
            digest, size = folder.write_pieces(name, pieces, sync=False)
            files[name] = {"sha256": digest, "bytes": size}
        folder.sync(list(payload))
        manifest = Manifest(run=self.run, step=source.step, policy_version=source.policy_version, files=files,
                            meta={**src.meta, "forked_from": f"{source.run}@{source.step}"})
        folder.write(MANIFEST, manifest.to_json(), atomic=True)
        ref = self.ref_for(source.step, source.policy_version)
        log.info("started run %s at %s (references %s' files, %d bytes written)", self.run, ref.uri, owners,
                 sum(int(files[n]["bytes"]) for n in payload))
        if publish:
            self.publish(ref)
        return ref

    def pinned_steps(self) -> dict[int, list[str]]:
        """step -> the forks (sorted) whose start version references this run's version ``step`` (``<run>/forks/``)."""
        pins = Folder(self._run.fs, self._run.join(FORKS))
        out: dict[int, list[str]] = {}
        for name in pins.listdir():
            if not name.endswith(".json"):
                continue
            try:
                body = json.loads(pins.fs.cat_file(pins.join(name)))
                out.setdefault(int(body["step"]), []).append(str(body["run"]))
            except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
                log.warning("ignoring damaged fork pin %s: %s", pins.uri(pins.join(name)), e)
        return {step: sorted(runs) for step, runs in sorted(out.items())}

    @staticmethod
    def _payload(weights, ema_weights, train_state, config, extra) -> dict[str, list[Piece]]:
        """File name -> pieces; tensors are streamed from their own memory (no serialised copy)."""
        def tensors(t: dict[str, Tensor], what: str) -> list[Piece]:
            header, ordered = tensorfile.encode(_checked(t, what), {"format": "pt"})
            return list(tensorfile.chunks(header, ordered))

        out = {WEIGHTS: []}  # the store's encoding writes the weights
        _checked(weights, "weights")
        if ema_weights is not None:
            out[EMA] = tensors(ema_weights, "ema_weights")
        if train_state is not None:
            buf = io.BytesIO()
            torch.save(train_state, buf)
            out[TRAIN_STATE] = [buf.getvalue()]
        if config is not None:
            out[CONFIG] = [_to_json(config, "config")]
        if extra:
            out[EXTRA] = [_to_json(extra, "extra")]
        return out

    def _base(self, memory: WeightsMemory | None, step: int) -> Base | None:
        """The version in ``memory`` when a delta may be taken against it: this run's, an earlier step, and still in
        the store as it was written (its manifest has the digest ``memory`` holds)."""
        if memory is None or memory.version is None:
            return None
        uri, base_step, sha, chain = memory.version
        if uri != self.uri or base_step >= step:
            return None
        m = self._read_manifest(self._version(base_step))
        if m is None or m.step != base_step or m.weights_sha256(WEIGHTS) != sha:
            return None
        return Base(step=base_step, sha256=sha, chain=chain)

    def publish(self, ref: CheckpointRef, *, retention: bool = True) -> None:
        """Point ``LATEST`` at ``ref`` (atomically), then apply retention (``retention=False``: the caller runs
        ``apply_retention`` later, e.g. on a writer thread off the step's path)."""
        if ref.run != self.run:
            raise field_error(CheckpointError, "ref.run", ref.run, f"{self.run!r}", "publish with the run's store")
        if self._read_manifest(self._version(ref.step)) is None:
            raise field_error(CheckpointError, ref.uri, "no valid manifest", "a complete version",
                              "save the version before publishing it")
        body = json.dumps({"step": ref.step, "policy_version": ref.policy_version, "dir": step_dirname(ref.step)})
        self._run.write(LATEST, body.encode(), atomic=True)
        if retention:
            self.apply_retention()

    def apply_retention(self) -> list[int]:
        """Delete versions outside keep_last / keep_every (never the published one, nor a version a kept delta
        version's chain needs, nor one a fork pinned) and stale partial folders. Returns the deleted steps."""
        manifests = self._complete()
        valid = sorted(manifests)
        pointed = self._pointer_step()
        keep = set(valid[-self.keep_last:])
        if self.keep_every:
            keep |= {s for s in valid if s % self.keep_every == 0}
        if pointed is not None:
            keep.add(pointed)
        keep |= set(self.pinned_steps())  # a fork references their files
        keep |= {link for s in list(keep) if s in manifests for link in manifests[s].chain}
        newest = valid[-1] if valid else -1
        doomed = [s for s in valid if s not in keep]
        partial = [s for s in self._steps_on_disk() if s not in valid and s < newest]
        raw = {}
        for step in doomed:
            folder = self._version(step)
            raw[step] = folder.fs.cat_file(folder.join(MANIFEST))
            folder.fs.rm_file(folder.join(MANIFEST))  # the version disappears atomically for readers
        # a fork that pinned one meanwhile (after the pins were read above) finds its manifest gone when it re-checks
        # (save_reference refuses) or pinned it before that: then it is put back and kept
        late = set(self.pinned_steps()) & set(doomed) if doomed else set()
        for step in sorted(late):
            self._version(step).write(MANIFEST, raw[step], atomic=True)
        doomed = [s for s in doomed if s not in late]
        for step in doomed + partial:
            folder = self._version(step)
            folder.fs.rm(folder.path, recursive=True)
        if doomed or partial:
            log.info("retention removed versions %s and partial folders %s", doomed, partial)
        return sorted(doomed + partial)

    # ------------------------------------------------------------------------------------------ read

    def _steps_on_disk(self) -> list[int]:
        steps = [parse_step_dirname(n) for n in self._run.listdir()]
        return sorted(s for s in steps if s is not None)

    def _read_manifest(self, folder: Folder) -> Manifest | None:
        try:
            data = folder.fs.cat_file(folder.join(MANIFEST))
        except FileNotFoundError:
            return None
        try:
            return Manifest.from_json(data, folder.uri(folder.join(MANIFEST)))
        except CheckpointError as e:
            log.warning("ignoring %s: %s", folder.uri(), e)
            return None

    def _complete(self) -> dict[int, Manifest]:
        """step -> manifest of every complete version."""
        out = {}
        for step in self._steps_on_disk():
            m = self._read_manifest(self._version(step))
            if m is not None and m.step == step:
                out[step] = m
        return out

    def versions(self) -> list[CheckpointRef]:
        """Complete versions (valid manifest), oldest first. Folders without one are invisible."""
        return [CheckpointRef(uri=self._version(step).uri(), run=self.run, step=step, policy_version=m.policy_version)
                for step, m in sorted(self._complete().items())]

    def _pointer_step(self) -> int | None:
        try:
            body = json.loads(self._run.fs.cat_file(self._run.join(LATEST)))
            return int(body["step"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring damaged pointer %s: %s", self._run.uri(self._run.join(LATEST)), e)
            return None

    def latest(self) -> CheckpointRef | None:
        """The published version (``LATEST``); falls back to the newest complete version if the pointer is
        missing or names a version that is gone. None for an empty run."""
        self._run.fs.invalidate_cache(self._run.path)
        step = self._pointer_step()
        if step is not None:
            folder = self._version(step)
            m = self._read_manifest(folder)
            if m is not None:
                return CheckpointRef(uri=folder.uri(), run=self.run, step=step, policy_version=m.policy_version)
            log.warning("LATEST names step %d without a valid manifest; using the newest complete version", step)
        found = self.versions()
        return found[-1] if found else None

    def history(self) -> list[dict[str, object]]:
        """Events recorded for the run (resumes that changed settings, forks), oldest first."""
        try:
            raw = self._run.fs.cat_file(self._run.join(HISTORY))
        except FileNotFoundError:
            return []
        try:
            events = json.loads(raw)
            if not isinstance(events, list):
                raise TypeError(f"a JSON list, got {type(events).__name__}")
        except (ValueError, TypeError) as e:
            log.warning("ignoring damaged %s: %s", self._run.uri(self._run.join(HISTORY)), e)
            return []
        return events

    def record(self, event: dict[str, object]) -> None:
        """Append ``event`` (JSON data) to ``<run>/history.json``, rewritten atomically (one writer per run).
        Versions and the pointer are not touched; the file is not part of any version."""
        self._run.write(HISTORY, _to_json([*self.history(), event], "history event"), atomic=True)

    def load(self, ref: CheckpointRef | None = None, *, train_state: bool = True) -> LoadedCheckpoint:
        """Read and verify a version (default: :meth:`latest`). Raises CheckpointError naming the bad file."""
        ref = ref or self.latest()
        if ref is None:
            raise field_error(CheckpointError, self.uri, "no versions", "at least one saved checkpoint",
                              "start the run from scratch, or point the store at the right root/run")
        return load_checkpoint(ref, storage_options=self.storage_options, train_state=train_state)


def _checked(tensors: dict[str, Tensor], what: str) -> dict[str, Tensor]:
    bad = [k for k, v in tensors.items() if not isinstance(v, Tensor)]
    if bad or not tensors:
        raise field_error(ConfigError, what, bad or "{}", "a non-empty dict of tensors",
                          "pass the model's (trainable) state dict")
    return tensors


def _open_version(ref: CheckpointRef, storage_options: dict[str, object] | None) -> tuple[Folder, Manifest]:
    fs, path = fsspec.core.url_to_fs(ref.uri, **(storage_options or {}))
    folder = Folder(fs, path.rstrip("/"))
    try:
        raw = fs.cat_file(folder.join(MANIFEST))
    except FileNotFoundError:
        raise field_error(CheckpointError, folder.uri(folder.join(MANIFEST)), "missing", "a manifest",
                          "the version is incomplete; resume from another one") from None
    return folder, Manifest.from_json(raw, folder.uri(folder.join(MANIFEST)))


def load_checkpoint(ref: CheckpointRef, *, storage_options: dict[str, object] | None = None,
                    train_state: bool = True) -> LoadedCheckpoint:
    """Read a version from its ref alone (what rollout/train tasks get); every file is checksum-verified."""
    folder, manifest = _open_version(ref, storage_options)

    def read(name: str) -> bytearray | None:
        return folder.read_verified(name, manifest) if name in manifest.files else None

    state = None
    if train_state and (blob := read(TRAIN_STATE)) is not None:
        state = torch.load(io.BytesIO(blob), weights_only=True)  # nothing beyond tensors and containers
    weights = _read_weights(folder, manifest)
    ema_blob = read(EMA)
    config_blob, extra_blob = read(CONFIG), read(EXTRA)
    where = folder.uri()
    return LoadedCheckpoint(
        ref=ref, manifest=manifest, weights=weights,
        ema_weights=tensorfile.decode(ema_blob, f"{where}/{EMA}") if ema_blob is not None else None,
        train_state=state,
        config=json.loads(config_blob) if config_blob is not None else None,
        extra=json.loads(extra_blob) if extra_blob is not None else {})


def load_manifest(ref: CheckpointRef, *, storage_options: dict[str, object] | None = None) -> Manifest:
    """A version's manifest alone (file names, sizes, sha256, step, policy version): no weights are read."""
    return _open_version(ref, storage_options)[1]


def load_version_json(ref: CheckpointRef, name: str, *,
                      storage_options: dict[str, object] | None = None) -> object | None:
    """One JSON file of a version (``config.json``, ``extra.json``), checksum-verified, without reading its
    weights; None when the version has no such file."""
    folder, manifest = _open_version(ref, storage_options)
    if name not in manifest.files:
        return None
    return json.loads(folder.read_verified(name, manifest))


def load_weights(ref: CheckpointRef, *, storage_options: dict[str, object] | None = None,
                 ema: bool = False) -> dict[str, Tensor]:
    """Only the (EMA) weights of a version, verified: what a rollout engine needs after publish."""
    folder, manifest = _open_version(ref, storage_options)
    if not ema:
        return _read_weights(folder, manifest)
    return tensorfile.decode(folder.read_verified(EMA, manifest), f"{folder.uri()}/{EMA}")


def _open_folder(folder: Folder) -> Manifest:
    try:
        raw = folder.fs.cat_file(folder.join(MANIFEST))
    except FileNotFoundError:
        raise field_error(CheckpointError, folder.uri(folder.join(MANIFEST)), "missing", "a manifest",
                          "a link of a delta chain is gone (or the version is incomplete); read another version") \
            from None
    return Manifest.from_json(raw, folder.uri(folder.join(MANIFEST)))


def _read_weights(folder: Folder, manifest: Manifest) -> dict[str, Tensor]:
    """A version's weights, verified: ``model.safetensors``, or for a delta version its chain walked from the
    full anchor (every link's file checked against its manifest, every link's base digest against the link
    before it). Errors name the file or manifest at fault."""
    if manifest.delta is None:
        if WEIGHTS not in manifest.files:
            raise field_error(CheckpointError, folder.uri(), "no weights", WEIGHTS, "the version is foreign or damaged")
        return tensorfile.decode(folder.read_verified(WEIGHTS, manifest), f"{folder.uri()}/{WEIGHTS}")
    parent = posixpath.dirname(folder.path)
    links = [(Folder(folder.fs, posixpath.join(parent, step_dirname(s))), None) for s in manifest.chain]
    links.append((folder, manifest))
    anchor_folder = links[0][0]
    anchor = _open_folder(anchor_folder)
    if anchor.delta is not None:
        raise field_error(CheckpointError, anchor_folder.uri(anchor_folder.join(MANIFEST)), "a delta version",
                          f"the full anchor of {folder.uri()}'s chain", "the chain is inconsistent; read another version")
    weights = _read_weights(anchor_folder, anchor)
    sha = anchor.weights_sha256(WEIGHTS)
    for link, m in links[1:]:
        m = m or _open_folder(link)
        where = link.uri(link.join(MANIFEST))
        if m.delta is None or m.delta["base_sha256"] != sha:
            raise field_error(CheckpointError, where, f"base sha256 {m.delta['base_sha256']}" if m.delta else "a full version",
                              f"a delta against weights sha256 {sha} (the version before it in the chain)",
                              "a link was rewritten since this version was written; read another version")
        name = str(m.delta["file"])
        weights = apply_delta(link.read_verified(name, m), int(m.delta["bytes"]), weights, f"{link.uri()}/{name}")
        sha = str(m.delta["sha256"])
    return weights


def read_delta(ref: CheckpointRef, *,
               storage_options: dict[str, object] | None = None) -> tuple[Manifest, bytearray | None]:
    """A version's manifest and, for a delta version, its verified delta file (None for a full version): what an
    engine that holds the delta's base (``manifest.delta['base_sha256']``) needs to reach the version."""
    folder, manifest = _open_version(ref, storage_options)
    if manifest.delta is None:
        return manifest, None
    return manifest, folder.read_verified(str(manifest.delta["file"]), manifest)
