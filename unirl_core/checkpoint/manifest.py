"""manifest.json: the record that makes a version folder exist, written after every other file."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

from unirl_core.errors import CheckpointError, field_error

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


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
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> bytes:
        body = {"schema_version": self.schema_version, "run": self.run, "step": self.step,
                "policy_version": self.policy_version, "created": self.created,
                "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
                "meta": self.meta, "files": self.files}
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; raises CheckpointError naming ``where`` on any problem."""
        try:
            body = json.loads(data)
            version = body["schema_version"]
            if version != SCHEMA_VERSION:
                raise field_error(CheckpointError, f"{where}: schema_version", version, f"{SCHEMA_VERSION}",
                                  "read it with the unirl version that wrote it")
            files = body["files"]
            for name, entry in files.items():
                if not (isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int)):
                    raise field_error(CheckpointError, f"{where}: files[{name!r}]", entry,
                                      "{'sha256': hex, 'bytes': int}", "the manifest is damaged")
            return cls(run=str(body["run"]), step=int(body["step"]), policy_version=int(body["policy_version"]),
                       files=files, created=float(body["created"]), meta=dict(body.get("meta", {})),
                       schema_version=version)
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
