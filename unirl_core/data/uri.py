"""Prompt rows from a URI: a local path or any fsspec URL (``s3://``, ``gs://``, ``https://``, ...), a directory
written by ``datasets.save_to_disk``, or a Hugging Face hub dataset by id (``hf://datasets/<org>/<name>``, through
``datasets.load_dataset``, where the ``datasets`` library is installed).

``read_rows`` reads the whole set (the run's dataset); ``probe_rows`` reads only the head of a file (the setup
task's preflight: the URI exists, has a known format, is not empty and its first rows parse and carry the prompt
field). Both raise a ``ConfigError`` naming the field, the URI and what was found there (missing, wrong format,
empty, malformed at line k, no such column).
"""

from __future__ import annotations

import io
import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from unirl_core.errors import ConfigError, field_error

HUB_PREFIX = "hf://datasets/"
FORMATS = (".jsonl", ".json", ".parquet", ".txt")
TXT_COLUMN = "prompt"
"""The one column of a ``.txt`` prompt set: one prompt per line (Flow-GRPO's ``dataset/<name>/train.txt``)."""
EXPECTED = ("a prompt set: a .jsonl / .json / .parquet / .txt file (local path or fsspec URL: s3://, https://, ...), a "
            "directory written by datasets.save_to_disk, or a hub dataset hf://datasets/<org>/<name>")
PROBE_BYTES = 1 << 20
"""The preflight reads at most this much of a jsonl file: existence, format and the first rows."""


@dataclass(frozen=True)
class Where:
    """The prompt set being read: its config field (for messages), URI, split and fsspec options."""

    field: str
    uri: str
    split: str | None = None
    storage_options: dict[str, Any] | None = None

    def error(self, found: str, fix: str) -> ConfigError:
        return field_error(ConfigError, self.field, self.uri, EXPECTED, f"found: {found}; {fix}")


def hub_dataset_id(uri: str) -> str | None:
    """``org/name`` of ``hf://datasets/org/name`` (a dataset by id); None for any other URI, including a file
    inside a hub dataset (``hf://datasets/org/name/train.jsonl``, read as a file through huggingface_hub's
    fsspec filesystem)."""
    if not uri.startswith(HUB_PREFIX):
        return None
    rest = uri[len(HUB_PREFIX):].strip("/")
    return rest if rest.count("/") == 1 and not rest.endswith(FORMATS) else None


def read_rows(where: Where) -> list[dict]:
    """Every row of the prompt set."""
    if (repo := hub_dataset_id(where.uri)) is not None:
        return _hub_rows(where, repo)
    fs, path = _open_fs(where)
    if fs.isdir(path):
        return _saved_dataset_rows(where, fs, path)
    fmt = _format(where, fs, path)
    data = _cat(where, fs, path)
    if not data.strip():
        raise where.error("an empty file (0 rows)", "fill it with one JSON object per line (jsonl) or point at "
                          "the right file")
    return _parse(where, fmt, data, complete=True)


def probe_rows(where: Where) -> tuple[list[dict], bool]:
    """The first rows of the prompt set and whether they are all of it (the whole file was read)."""
    if (repo := hub_dataset_id(where.uri)) is not None:
        return _hub_rows(where, repo, probe=True), False
    fs, path = _open_fs(where)
    if fs.isdir(path):
        return _saved_dataset_rows(where, fs, path), True
    fmt = _format(where, fs, path)
    size = _size(fs, path)
    if fmt == ".parquet":
        rows = _parquet_head(where, fs, path)
        return rows, False
    if size is not None and size > PROBE_BYTES and fmt in (".jsonl", ".txt"):
        with fs.open(path, "rb") as f:
            head = f.read(PROBE_BYTES)
        head = head[:head.rfind(b"\n") + 1]  # complete lines only
        if not head.strip():
            raise where.error(f"no line break in the first {PROBE_BYTES} bytes", "write one JSON object per line")
        return _parse(where, fmt, head, complete=False), False
    data = _cat(where, fs, path)
    if not data.strip():
        raise where.error("an empty file (0 rows)", "fill it with one JSON object per line (jsonl) or point at "
                          "the right file")
    return _parse(where, fmt, data, complete=True), True


def _open_fs(where: Where) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return fsspec.core.url_to_fs(where.uri, **(where.storage_options or {}))
    except (ImportError, ValueError) as e:
        raise where.error(f"no filesystem for this URL ({type(e).__name__}: {e})",
                          "install the fsspec implementation of that protocol (s3fs, gcsfs, aiohttp for https) or "
                          "fix the URL") from e


def _guard(where: Where, call: Callable[[], Any]) -> Any:
    """``call()``; a missing file or an unreachable store becomes the field's error."""
    try:
        return call()
    except FileNotFoundError as e:
        raise where.error("nothing at this URI (missing file)", "fix the path (a relative path starts at the "
                          "task's working directory; cluster pods see no local files: use s3:// or https://)") from e
    except (PermissionError, OSError) as e:
        raise where.error(f"an unreadable location ({type(e).__name__}: {str(e)[:200]})",
                          "check the credentials (AWS_* environment or data.file.storage_options) and the "
                          "network") from e


def _size(fs: fsspec.AbstractFileSystem, path: str) -> int | None:
    try:
        return fs.size(path)
    except (FileNotFoundError, OSError, NotImplementedError, ValueError):
        return None


def _format(where: Where, fs: fsspec.AbstractFileSystem, path: str) -> str:
    if not _guard(where, lambda: fs.exists(path)):
        _guard(where, lambda: fs.info(path))  # the filesystem's own FileNotFoundError, or the reason it failed
        raise where.error("nothing at this URI (missing file)", "fix the path, or write the prompt file there")
    suffix = posixpath.splitext(path.split("?")[0])[1].lower()
    if suffix not in FORMATS:
        raise where.error(f"a file with suffix {suffix or '(none)'!r}", "convert the prompts to jsonl (one JSON "
                          "object per line), parquet or .txt (one prompt per line), and name the file accordingly")
    return suffix


def _cat(where: Where, fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    return _guard(where, lambda: fs.cat_file(path))


def _parse(where: Where, fmt: str, data: bytes, *, complete: bool) -> list[dict]:
    if fmt == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(pa.BufferReader(data)).to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise where.error(f"a file that is not parquet ({str(e)[:200]})", "rewrite it as parquet or jsonl") from e
    if fmt == ".json":
        try:
            rows = json.loads(data)
        except ValueError as e:
            raise where.error(f"malformed JSON ({e})", "write a JSON list of objects, or jsonl") from e
        if not isinstance(rows, list):
            raise where.error(f"a JSON {type(rows).__name__}, not a list of rows", "write a JSON list of objects")
        return _objects(where, rows, lambda i: f"item {i}")
    if fmt == ".txt":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise where.error(f"a .txt file that is not UTF-8 ({e})", "write one UTF-8 prompt per line") from e
        return _objects(where, [{TXT_COLUMN: line.strip()} for line in text.splitlines() if line.strip()],
                        lambda i: f"line {i}")
    rows = []
    for k, line in enumerate(io.BytesIO(data), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            raise where.error(f"malformed JSON at line {k} ({e}): {line[:80]!r}",
                              "each line must be one JSON object, e.g. {\"prompt\": \"a cat\"}") from e
    return _objects(where, rows, lambda i: f"row {i}")


def _objects(where: Where, rows: list, name: Callable[[int], str]) -> list[dict]:
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise where.error(f"{name(i)} is a JSON {type(row).__name__}, not an object",
                              "write one object per row, e.g. {\"prompt\": \"a cat\"}")
    if not rows:
        raise where.error("no rows (only blank lines)", "fill it with one JSON object per line")
    return rows


def _parquet_head(where: Where, fs: fsspec.AbstractFileSystem, path: str) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            if pf.metadata.num_rows == 0:
                raise where.error("a parquet file with 0 rows", "point at the file that holds the prompts")
            return pf.read_row_group(0).slice(0, 8).to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise where.error(f"a file that is not parquet ({str(e)[:200]})", "rewrite it as parquet or jsonl") from e


def _import_datasets(where: Where, what: str):
    try:
        import datasets
    except ModuleNotFoundError as e:
        raise where.error(f"{what}, but the datasets package is not installed",
                          "pip install datasets (the lm extra), or export the prompts to jsonl / parquet") from e
    return datasets


def _saved_dataset_rows(where: Where, fs: fsspec.AbstractFileSystem, path: str) -> list[dict]:
    datasets = _import_datasets(where, "a directory")
    if not isinstance(fs, LocalFileSystem):
        raise where.error("a remote directory", "copy a saved dataset locally, or point at a .jsonl / .parquet "
                          "file or hf://datasets/<org>/<name>")
    try:
        ds = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise where.error(f"a directory that is no saved dataset ({str(e)[:200]})",
                          "write it with datasets.Dataset.save_to_disk, or point at a file") from e
    if isinstance(ds, datasets.DatasetDict):
        if where.split not in ds:
            raise field_error(ConfigError, "data.file.split", where.split, f"one of {sorted(ds)}", "name a split")
        ds = ds[where.split]
    return _nonempty(where, [dict(r) for r in ds])


def _hub_rows(where: Where, repo: str, *, probe: bool = False) -> list[dict]:
    datasets = _import_datasets(where, f"hub dataset {repo!r}")
    split = where.split or "train"
    try:
        if probe:  # streaming: the first rows only, no download of the whole set
            ds = datasets.load_dataset(repo, split=split, streaming=True)
            return _nonempty(where, [dict(r) for _, r in zip(range(8), ds, strict=False)])
        return _nonempty(where, [dict(r) for r in datasets.load_dataset(repo, split=split)])
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as e:
        if isinstance(e, ConfigError):
            raise
        raise where.error(f"hub dataset {repo!r} split {split!r} could not be loaded ({type(e).__name__}: "
                          f"{str(e)[:200]})", "check the id and data.file.split, HF_TOKEN for a gated or "
                          "private dataset, or HF_HUB_OFFLINE with the dataset cached") from e


def _nonempty(where: Where, rows: list[dict]) -> list[dict]:
    if not rows:
        raise where.error("a dataset with 0 rows", "point at the split that holds the prompts")
    return rows
