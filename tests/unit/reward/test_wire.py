"""Arrow IPC wire format: round trips (NaN, None, raw PNG bytes) and damaged bodies."""

import math

import pytest

from unirl_core.errors import SchemaError
from unirl_core.reward import ComponentScores, RewardComponent, ScoreItem
from unirl_core.reward.wire import decode_request, decode_response, encode_request, encode_response


def test_request_round_trip():
    items = [ScoreItem(prompt='say "hi"', media=b"\x89PNG\r\n\x1a\n\x00raw", targets={"ocr_text": "hi"}),
             ScoreItem(prompt="2+2", text="4", num_tokens=3)]
    comps = [RewardComponent(name="ocr", kwargs={"num_threads": 1}), RewardComponent(name="math")]
    got_items, got_comps, isolate = decode_request(encode_request(items, comps, isolate=True))
    assert got_items == items and isolate is True
    assert [(c.name, c.kwargs) for c in got_comps] == [("ocr", {"num_threads": 1}), ("math", {})]


def test_response_round_trip_keeps_nan_and_errors():
    res = [ComponentScores(values=[1.0, math.nan], errors=[None, "ValueError: x"]),
           ComponentScores(values=[0.5, -2.0], errors=[None, None])]
    got = decode_response(encode_response(res), num_components=2, num_items=2)
    assert got[0].values[0] == 1.0 and math.isnan(got[0].values[1]) and got[0].errors == [None, "ValueError: x"]
    assert got[1].values == [0.5, -2.0]
    with pytest.raises(SchemaError, match="disagree"):
        decode_response(encode_response(res), num_components=1, num_items=2)


def test_damaged_bodies():
    with pytest.raises(SchemaError, match="not an Arrow IPC stream"):
        decode_request(b"garbage")
    body = encode_request([ScoreItem()], [RewardComponent(name="ocr")], isolate=False)
    with pytest.raises(SchemaError):
        decode_request(body[: len(body) // 2])
