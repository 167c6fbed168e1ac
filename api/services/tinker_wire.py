"""The Tinker SDK's wire formats: its protobuf forward_backward bodies and sample/forward_backward results
(``tinker.proto.tinker_public_pb2``, shipped in the SDK wheel), and its JSON datum shape, to and from plain rows."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from api.errors import ApiError
from gspo_core.data import JsonValueError, loads_strict

PROTOBUF = "application/x-protobuf"
_INPUT_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}  # public DType enum: FLOAT32, INT64, INT32


def _pb() -> Any:  # imported on first use: the rest of the API runs without the SDK installed
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise ApiError(501, "not_implemented", "the Tinker API needs the `tinker` package on the API host") from exc
    return tinker_public_pb2


def _bad(message: str, field: str) -> ApiError:
    return ApiError(400, "invalid_request", message, field=field)


def fwdbwd_from_proto(body: bytes) -> dict[str, Any]:
    """A protobuf ForwardBackwardRequest as ``{model_id, loss, loss_config, forward_only, data}``."""
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:
        raise _bad(f"not a ForwardBackwardRequest protobuf: {exc}", "body") from exc
    config: dict[str, Any] = {
        k: v.text if v.WhichOneof("value") == "text" else v.number for k, v in msg.loss_fn_config_v2.items()
    }
    for key, number in msg.loss_fn_config.items():
        config.setdefault(key, number)
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise _bad("only encoded_text chunks are supported (no images or audio)", f"data[{i}].model_input")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {}
        for name, tensor in datum.loss_fn_inputs.items():
            if tensor.WhichOneof("encoding") != "dense" or tensor.dtype not in _INPUT_DTYPES:
                raise _bad("loss_fn_inputs must be dense float32 or int64 tensors", f"data[{i}].loss_fn_inputs.{name}")
            inputs[name] = np.frombuffer(tensor.dense, dtype=_INPUT_DTYPES[tensor.dtype]).tolist()
        data.append({"tokens": tokens, "inputs": inputs})
    return {
        "model_id": msg.model_id,
        "loss": msg.loss_fn,
        "loss_config": config,
        "forward_only": msg.forward_only,
        "data": data,
    }


def _tensor_list(value: Any, field: str) -> list:
    if isinstance(value, dict) and "data" in value:
        return list(value["data"])
    if isinstance(value, list):
        return value
    raise _bad("a loss_fn_input is a TensorData object {data, dtype, shape} or a list", field)


def fwdbwd_from_json(body: dict[str, Any], forward_only: bool) -> dict[str, Any]:
    """The SDK's JSON ForwardBackwardRequest (``forward_backward_input: {data, loss_fn, loss_fn_config}``)."""
    fb = body.get("forward_backward_input")
    if not isinstance(fb, dict) or not isinstance(fb.get("data"), list):
        raise _bad("forward_backward_input with a data list is required", "forward_backward_input")
    data = []
    for i, datum in enumerate(fb["data"]):
        chunks = (datum.get("model_input") or {}).get("chunks") or []
        tokens = [t for chunk in chunks for t in chunk.get("tokens", [])]
        inputs = {
            k: _tensor_list(v, f"data[{i}].loss_fn_inputs.{k}") for k, v in (datum.get("loss_fn_inputs") or {}).items()
        }
        data.append({"tokens": tokens, "inputs": inputs})
    return {
        "model_id": body.get("model_id", ""),
        "loss": fb.get("loss_fn", ""),
        "loss_config": fb.get("loss_fn_config") or {},
        "forward_only": forward_only,
        "data": data,
    }


def fwdbwd_output_proto(result: dict[str, Any]) -> bytes:
    """``{logprobs: [[float]], metrics}`` as a protobuf ForwardBackwardOutput (one ArrayRecord, field logprobs)."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=result.get("metrics", {}))
    rows = [np.asarray(r, dtype=np.float32) for r in result.get("logprobs", [])]
    offsets = np.cumsum([0] + [r.nbytes for r in rows]).astype(np.int64)
    record = out.loss_fn_outputs.add(num_datums=len(rows), type_tag="ArrayRecord")
    field = record.fields["logprobs"]
    field.data = b"".join(r.tobytes() for r in rows)
    field.offsets = offsets.tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    return out.SerializeToString()


def fwdbwd_output_json(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [
            {"logprobs": {"data": r, "dtype": "float32", "shape": [len(r)]}} for r in result.get("logprobs", [])
        ],
        "metrics": result.get("metrics", {}),
    }


def sample_output_proto(result: dict[str, Any]) -> bytes:
    """``{sequences: [{tokens, logprobs, stop_reason}], prompt_logprobs}`` as a protobuf SampleResponse."""
    pb = _pb()
    out = pb.SampleResponse()
    for seq in result.get("sequences", []):
        item = out.sequences.add()
        item.tokens = np.asarray(seq["tokens"], dtype=np.int32).tobytes()
        item.logprobs = np.asarray(seq["logprobs"], dtype=np.float32).tobytes()
        item.stop_reason = pb.STOP_REASON_LENGTH if seq["stop_reason"] == "length" else pb.STOP_REASON_STOP
    prompt = result.get("prompt_logprobs")
    if prompt is not None:
        out.prompt_logprobs = np.asarray([math.nan if v is None else v for v in prompt], dtype=np.float32).tobytes()
    return out.SerializeToString()


def fwdbwd_payload(body: bytes, content_type: str, content_encoding: str | None, forward_only: bool) -> dict[str, Any]:
    """A forward(_backward) body, protobuf or JSON as its Content-Type says, as ``fwdbwd_from_proto`` rows."""
    if PROTOBUF in content_type:
        if content_encoding:
            raise ApiError(415, "unsupported_media_type", "compressed bodies are not accepted", "Content-Encoding")
        return fwdbwd_from_proto(body)
    try:
        parsed = loads_strict(body)  # bounded nesting, finite numbers, bounded integers (api/bodies.py)
    except JsonValueError as exc:
        raise ApiError(400, "invalid_request", f"{exc.path or 'body'}: {exc.message}", exc.path or "body") from None
    except ValueError as exc:
        raise ApiError(400, "invalid_request", f"body is neither protobuf nor JSON: {exc}", "body") from None
    if not isinstance(parsed, dict):
        raise ApiError(400, "invalid_request", "body must be a JSON object", "body")
    return fwdbwd_from_json(parsed, forward_only or bool(parsed.get("forward_only")))


def encode_result(kind: str, result: dict[str, Any], accept: str) -> bytes | dict[str, Any]:
    """A finished request's result for the SDK: protobuf bytes where it accepts them and has a message, else JSON."""
    proto = PROTOBUF in accept
    if kind in ("forward", "forward_backward"):
        return fwdbwd_output_proto(result) if proto else fwdbwd_output_json(result)
    if kind == "sample" and proto:
        return sample_output_proto(result)
    return result
