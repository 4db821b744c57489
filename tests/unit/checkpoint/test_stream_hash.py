"""StreamHash / write_local: pieces hashed on a helper thread while the file is written, digest still the file's."""

import hashlib
import os

import pytest

from unirl_core.checkpoint import fsio


def _pieces(sizes: list[int]) -> list[bytes]:
    return [os.urandom(n) for n in sizes]


@pytest.mark.parametrize("sizes", [
    [],
    [5],
    [fsio.HASH_AHEAD - 1, fsio.HASH_AHEAD, fsio.HASH_AHEAD + 1],  # inline, then the helper thread
    [3, 2 * fsio.HASH_AHEAD, 7, fsio.HASH_AHEAD, 0, 11],  # small pieces after the first big one queue too
])
def test_write_local_digest_and_bytes_are_the_files(tmp_path, sizes):
    pieces = _pieces(sizes)
    whole = b"".join(pieces)
    path = tmp_path / "f.bin"
    digest, size = fsio.write_local(str(path), [memoryview(p) for p in pieces])
    assert path.read_bytes() == whole
    assert (digest, size) == (hashlib.sha256(whole).hexdigest(), len(whole))


def test_piece_order_matters_to_the_digest(tmp_path):
    a, b = os.urandom(fsio.HASH_AHEAD), os.urandom(fsio.HASH_AHEAD)
    d1, _ = fsio.write_local(str(tmp_path / "1"), [a, b])
    d2, _ = fsio.write_local(str(tmp_path / "2"), [b, a])
    assert d1 == hashlib.sha256(a + b).hexdigest() and d2 == hashlib.sha256(b + a).hexdigest() and d1 != d2


def test_a_failed_write_raises_and_leaves_no_hash_running(tmp_path, monkeypatch):
    class Broken:
        """A stream whose second piece cannot be produced (a failed staging copy, say)."""

        def __iter__(self):
            yield os.urandom(2 * fsio.HASH_AHEAD)  # hashed on the helper thread
            raise OSError("disk full")

    made = []

    class Recorded(fsio.StreamHash):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(fsio, "StreamHash", Recorded)
    with pytest.raises(OSError, match="disk full"):
        fsio.write_local(str(tmp_path / "f"), Broken())
    # the first piece's hash was joined before the error left write_local: nothing reads the caller's memory later
    assert len(made) == 1 and made[0]._queue is None and made[0]._worker is None
    assert made[0].size == 2 * fsio.HASH_AHEAD


def test_stream_hash_matches_hashlib_for_many_pieces():
    h, ref = fsio.StreamHash(), hashlib.sha256()
    for i in range(40):
        piece = os.urandom((i % 3) * fsio.HASH_AHEAD + i)
        h.feed(piece)
        ref.update(piece)
    assert h.hexdigest() == ref.hexdigest() and h.size == sum((i % 3) * fsio.HASH_AHEAD + i for i in range(40))
