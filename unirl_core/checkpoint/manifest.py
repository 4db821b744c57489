"""manifest.json: the record that makes a version folder exist, written after every other file."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

from unirl_core.errors import CheckpointError, field_error

SCHEMA_VERSION = 2
"""Written by a delta version (its manifest has ``delta``); a full version's manifest keeps version 1, so readers
older than delta versions read every full version and refuse a delta version by its schema."""
FULL_SCHEMA_VERSION = 1
READABLE = (1, 2)
MANIFEST = "manifest.json"
DELTA_KEYS = {"file": str, "base": int, "base_sha256": str, "chain": list, "sha256": str, "bytes": int}


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a version folder holds and the checksums to prove it."""

    run: str
    step: int
    policy_version: int
    files: dict[str, dict[str, object]]
    """Relative file name -> ``{"sha256": hex, "bytes": size}``."""
    created: float = field(default_factory=time.time)
    """Unix time the manifest was written."""
    meta: dict[str, str] = field(default_factory=dict)
    """Free-form strings (weights scope, writer world size, ...)."""
    delta: dict[str, object] | None = None
    """A delta version's weights (``checkpoint.delta``): ``file`` (the payload file holding them), ``base`` (the step
    of the version it is the XOR against) and ``base_sha256`` (that version's weights digest), ``chain`` (every step
    a read needs, oldest first: the full anchor, then each delta before this one), ``sha256`` / ``bytes`` (digest and
    size of the weights' safetensors encoding, what ``model.safetensors`` would hold). None: the weights are
    ``model.safetensors`` itself."""
    schema_version: int = FULL_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.delta is not None and self.schema_version < SCHEMA_VERSION:
            object.__setattr__(self, "schema_version", SCHEMA_VERSION)

    @property
    def chain(self) -> list[int]:
        """The steps whose files a read of this version's weights needs besides its own (oldest first)."""
        return [int(s) for s in self.delta["chain"]] if self.delta is not None else []

    def weights_sha256(self, weights_file: str) -> str | None:
        """The digest of the version's weights as a safetensors encoding: ``model.safetensors``'s sha256 for a full
        version, the recorded one for a delta version (what an engine fed the delta checks its result against)."""
        if self.delta is not None:
            return str(self.delta["sha256"])
        entry = self.files.get(weights_file)
        return None if entry is None else str(entry["sha256"])

    def to_json(self) -> bytes:
        body = {"schema_version": self.schema_version, "run": self.run, "step": self.step,
                "policy_version": self.policy_version, "created": self.created,
                "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
                "meta": self.meta, "files": self.files}
        if self.delta is not None:
            body["delta"] = self.delta
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; raises CheckpointError naming ``where`` on any problem."""
        try:
            body = json.loads(data)
            version = body["schema_version"]
            if version not in READABLE:
                raise field_error(CheckpointError, f"{where}: schema_version", version, f"one of {READABLE}",
                                  "read it with the unirl version that wrote it")
            files = body["files"]
            for name, entry in files.items():
                if not (isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int)):
                    raise field_error(CheckpointError, f"{where}: files[{name!r}]", entry,
                                      "{'sha256': hex, 'bytes': int}", "the manifest is damaged")
            delta = body.get("delta")
            if delta is not None:
                bad = {k: delta.get(k) for k, t in DELTA_KEYS.items() if not isinstance(delta.get(k), t)}
                if bad or delta["file"] not in files or not all(isinstance(s, int) for s in delta["chain"]):
                    raise field_error(CheckpointError, f"{where}: delta", delta, "{'file': a listed file, 'base': "
                                      "int, 'base_sha256': hex, 'chain': [int], 'sha256': hex, 'bytes': int}",
                                      "the manifest is damaged")
            return cls(run=str(body["run"]), step=int(body["step"]), policy_version=int(body["policy_version"]),
                       files=files, created=float(body["created"]), meta=dict(body.get("meta", {})),
                       delta=delta, schema_version=version)
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise field_error(CheckpointError, where, f"{type(e).__name__}: {e}", "a valid manifest.json",
                              "the version is incomplete or damaged; it is ignored by loaders") from e

    def verify(self, name: str, data: bytes, where: str) -> None:
        """Raise CheckpointError naming the file when ``data`` is not the bytes the manifest recorded."""
        self.verify_digest(name, len(data), sha256_hex(data), where)

    def verify_digest(self, name: str, size: int, digest: str, where: str) -> None:
        """Like :meth:`verify` for a file whose size and sha256 were computed while streaming it."""
        entry = self.files.get(name)
        if entry is None:
            raise field_error(CheckpointError, f"{where}/{name}", "not in manifest", f"one of {sorted(self.files)}",
                              "the file is not part of this checkpoint version")
        if size != entry["bytes"]:
            raise field_error(CheckpointError, f"{where}/{name}", f"{size} bytes", f"{entry['bytes']} bytes",
                              "the file is truncated or was replaced; restore it or use another version")
        if digest != entry["sha256"]:
            raise field_error(CheckpointError, f"{where}/{name}", f"sha256 {digest}", f"sha256 {entry['sha256']}",
                              "the file is corrupted; restore it or resume from another version")
