"""The Tinker wire codec against the SDK's own converters: what the SDK encodes we decode, and back."""

from __future__ import annotations

import math

import pytest

from api.errors import ApiError
from api.services import tinker_wire

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402


def _request(loss: str = "ppo", config: dict | None = None) -> types.ForwardBackwardRequest:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4, 5]),
        loss_fn_inputs={"target_tokens": [4, 5, 6], "logprobs": [-1.0, -0.5, -0.25], "advantages": [1.0, 1.0, 1.0]},
    )
    fb = types.ForwardBackwardInput(data=[datum, datum], loss_fn=loss, loss_fn_config=config)
    return types.ForwardBackwardRequest(forward_backward_input=fb, model_id="ts_x:train:0", seq_id=1)


def test_forward_backward_protobuf_decodes_as_the_sdk_encoded_it():
    body = forward_backward_request_to_proto(_request(config={"clip_low_threshold": 0.8})).SerializeToString()
    payload = tinker_wire.fwdbwd_from_proto(body)
    assert payload["model_id"] == "ts_x:train:0" and payload["loss"] == "ppo"
    assert payload["loss_config"] == {"clip_low_threshold": pytest.approx(0.8)}
    assert payload["data"][0]["tokens"] == [3, 4, 5]
    assert payload["data"][0]["inputs"]["target_tokens"] == [4, 5, 6]
    assert payload["data"][1]["inputs"]["logprobs"] == [-1.0, -0.5, -0.25]


def _tensor(values: list, dtype: str) -> dict:
    return {"data": values, "dtype": dtype, "shape": [len(values)]}


def test_forward_backward_json_body_decodes_like_the_protobuf_one():
    """The JSON shape SDKs before protobuf bodies sent (0.38 sends protobuf only)."""
    request = _request()
    datum = {
        "model_input": {"chunks": [{"tokens": [3, 4, 5], "type": "encoded_text"}]},
        "loss_fn_inputs": {
            "target_tokens": _tensor([4, 5, 6], "int64"),
            "logprobs": _tensor([-1.0, -0.5, -0.25], "float32"),
            "advantages": [1.0, 1.0, 1.0],
        },
    }
    json_body = {"forward_backward_input": {"data": [datum, datum], "loss_fn": "ppo"}, "model_id": "ts_x:train:0"}
    from_json = tinker_wire.fwdbwd_from_json(json_body, forward_only=False)
    from_proto = tinker_wire.fwdbwd_from_proto(forward_backward_request_to_proto(request).SerializeToString())
    assert from_json["data"] == from_proto["data"] and from_json["loss"] == from_proto["loss"]


def test_a_body_that_is_not_protobuf_is_a_400_naming_the_body():
    with pytest.raises(ApiError) as err:
        tinker_wire.fwdbwd_from_proto(b"\xff\xff\xff")
    assert err.value.status == 400 and err.value.field == "body"


def test_results_encode_as_the_sdk_decodes_them():
    fb = deserialize_forward_backward_output(
        tinker_wire.fwdbwd_output_proto({"logprobs": [[-1.0, -2.0], [-0.5]], "metrics": {"loss:sum": 3.5}})
    )
    assert [o["logprobs"].tolist() for o in fb.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert fb.metrics == {"loss:sum": 3.5}
    sample = deserialize_sample_response(
        tinker_wire.sample_output_proto(
            {
                "sequences": [{"tokens": [7, 8], "logprobs": [-0.1, -0.2], "stop_reason": "length"}],
                "prompt_logprobs": [None, -1.5],
            }
        )
    )
    assert sample.sequences[0].tokens == [7, 8] and sample.sequences[0].stop_reason == "length"
    assert sample.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert sample.prompt_logprobs is not None and sample.prompt_logprobs[0] is None
    assert math.isclose(sample.prompt_logprobs[1], -1.5)


def test_the_api_accepts_exactly_the_losses_the_primitives_register():
    """The API checks loss names without importing torch: its list must be the primitives' registry."""
    import gspo_core.datum_losses  # noqa: F401  (registers them)
    from api.services.tinker import LOSSES
    from gspo_core.registry import DATUM_LOSSES

    assert sorted(LOSSES) == DATUM_LOSSES.names()
