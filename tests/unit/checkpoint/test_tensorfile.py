import json
import struct

import pytest
import safetensors.torch
import torch

from unirl_core.checkpoint.tensorfile import chunks, decode, encode, encoded_size
from unirl_core.errors import CheckpointError


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=g).half(), "f64": torch.randn(3, generator=g).double(),
        "i64": torch.arange(5), "i8": torch.arange(-3, 4, dtype=torch.int8), "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "f8": torch.randn(3, generator=g).to(torch.float8_e4m3fn),
        "strided": torch.randn(4, 6, generator=g).t(),
    }


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)  # bit patterns; float8 has no equality kernel


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k])) for k in a)


def written(t: dict) -> bytes:
    header, ordered = encode(t, {"format": "pt"})
    data = b"".join(bytes(c) for c in chunks(header, ordered))
    assert len(data) == encoded_size(header, ordered)
    return data


def test_files_we_write_are_read_by_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(written(sample()))
    assert same(safetensors.torch.load_file(str(path)), {k: v.contiguous() for k, v in sample().items()})


def test_we_read_files_safetensors_writes():
    t = {k: v.contiguous() for k, v in sample().items()}
    assert same(decode(bytearray(safetensors.torch.save(t)), "x"), t)


def test_decoded_tensors_view_the_buffer_without_copies():
    buf = bytearray(written({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int64)}))
    got = decode(buf, "x")
    got["a"][0] = 1.0
    got2 = decode(buf, "x")
    assert got2["a"][0] == 1.0  # the same memory


def test_misaligned_foreign_offsets_are_copied_not_misread():
    header = {"a": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    body = bytes([7]) + torch.tensor([1.5, -2.0]).numpy().tobytes()
    got = decode(bytearray(struct.pack("<Q", len(raw)) + raw + body), "x")
    assert got["a"].tolist() == [7] and got["b"].tolist() == [1.5, -2.0]


@pytest.mark.parametrize("bad", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}",
                                 struct.pack("<Q", 40) + b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'])
def test_garbage_is_a_checkpoint_error_naming_the_file(bad):
    with pytest.raises(CheckpointError, match="dir/model.safetensors"):
        decode(bytearray(bad), "dir/model.safetensors")


def test_unsupported_dtype_is_rejected():
    with pytest.raises(CheckpointError, match="dtype"):
        encode({"c": torch.zeros(2, dtype=torch.complex64)})
