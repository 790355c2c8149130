"""The binary half of the Tinker protocol: the protobuf messages the `tinker` SDK sends for
`forward_backward` and expects back from `retrieve_future` for forward_backward and sample results.

The messages (package `tinker_public`, as the SDK 0.38 defines them) are built here at import from
their field table with the `protobuf` runtime, no generated code and no SDK. Only the parts this
service reads or writes are declared: a field the table leaves out (an image chunk, a provenance
span) is kept by protobuf as unknown and found missing where it matters. Tensors travel as raw
little-endian bytes with a dtype and a shape (`Tensor`), or batched as concatenated bytes with byte
offsets (`BatchedTensor`, one entry per datum).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64,
            "uint32": _F.TYPE_UINT32, "double": _F.TYPE_DOUBLE, "bool": _F.TYPE_BOOL}
# message -> [(field, number, type, label)]; type a scalar, "enum:<Name>", a message name, or
# "map:<value type>" (string keys); label "" (singular), "repeated", "optional", or "oneof:<name>"
_MESSAGES: dict[str, list[tuple[str, int, str, str]]] = {
    "SparseCsr": [("values", 1, "bytes", ""), ("crow_indices", 2, "bytes", ""), ("col_indices", 3, "bytes", "")],
    "Tensor": [("dense", 1, "bytes", "oneof:encoding"), ("sparse_csr", 2, "SparseCsr", "oneof:encoding"),
               ("dtype", 3, "enum:DType", ""), ("shape", 4, "int64", "repeated")],
    "BatchedTensor": [("data", 1, "bytes", ""), ("offsets", 2, "bytes", ""), ("dtype", 3, "enum:DType", ""),
                      ("trailing_shape", 4, "int64", "repeated")],
    "ArrayRecord": [("type_tag", 1, "string", ""), ("fields", 2, "map:BatchedTensor", ""),
                    ("num_datums", 3, "int64", "")],
    "ForwardBackwardOutput": [("loss_fn_output_type", 1, "string", ""),
                              ("loss_fn_outputs", 2, "ArrayRecord", "repeated"), ("metrics", 3, "map:double", "")],
    "EncodedTextChunk": [("tokens", 1, "bytes", "")],
    "Chunk": [("encoded_text", 1, "EncodedTextChunk", "oneof:chunk")],
    "Datum": [("model_input", 1, "Chunk", "repeated"), ("loss_fn_inputs", 2, "map:Tensor", "")],
    "LossConfigValue": [("number", 1, "double", "oneof:value"), ("text", 2, "string", "oneof:value")],
    "ForwardBackwardRequest": [("model_id", 1, "string", ""), ("seq_id", 2, "int32", ""),
                               ("data", 3, "Datum", "repeated"), ("loss_fn", 4, "string", ""),
                               ("loss_fn_config", 5, "map:double", ""), ("forward_only", 6, "bool", ""),
                               ("loss_fn_config_v2", 7, "map:LossConfigValue", "")],
    "TopkLogprobs": [("token_ids", 1, "bytes", ""), ("logprobs", 2, "bytes", ""), ("k", 3, "uint32", ""),
                     ("length", 4, "uint32", "")],
    "SampledSequence": [("stop_reason", 1, "enum:StopReason", ""), ("tokens", 2, "bytes", ""),
                        ("logprobs", 3, "bytes", "optional")],
    "SampleResponse": [("sequences", 1, "SampledSequence", "repeated"), ("prompt_logprobs", 2, "bytes", "optional"),
                       ("topk_prompt_logprobs", 3, "TopkLogprobs", "optional"),
                       ("prompt_cache_hit_tokens", 4, "int32", "")],
}
_ENUMS = {"DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
          "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"]}
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_NUMPY = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}


def _field(message: descriptor_pb2.DescriptorProto, name: str, number: int, kind: str, label: str,
           oneofs: dict[str, int]) -> None:
    f = message.field.add(name=name, number=number)
    f.label = _F.LABEL_REPEATED if label == "repeated" else _F.LABEL_OPTIONAL
    if kind.startswith("map:"):  # a map is a repeated nested entry message, as protoc writes it
        entry = message.nested_type.add(name="".join(p.title() for p in name.split("_")) + "Entry")
        entry.options.map_entry = True
        _field(entry, "key", 1, "string", "", {})
        _field(entry, "value", 2, kind[4:], "", {})
        f.label, f.type, f.type_name = _F.LABEL_REPEATED, _F.TYPE_MESSAGE, f".tinker_public.{message.name}.{entry.name}"
    elif kind in _SCALARS:
        f.type = _SCALARS[kind]
    elif kind.startswith("enum:"):
        f.type, f.type_name = _F.TYPE_ENUM, f".tinker_public.{kind[5:]}"
    else:
        f.type, f.type_name = _F.TYPE_MESSAGE, f".tinker_public.{kind}"
    if label.startswith("oneof:") or label == "optional":
        group = label[6:] if label.startswith("oneof:") else f"_{name}"  # proto3 `optional`: a synthetic oneof
        if group not in oneofs:
            oneofs[group] = len(message.oneof_decl)
            message.oneof_decl.add(name=group)
        f.oneof_index = oneofs[group]
        f.proto3_optional = label == "optional"


def _build() -> dict[str, type]:
    file = descriptor_pb2.FileDescriptorProto(name="rlpost_tinker_public.proto", package="tinker_public",
                                              syntax="proto3")
    for name, values in _ENUMS.items():
        enum = file.enum_type.add(name=name)
        for i, value in enumerate(values):
            enum.value.add(name=value, number=i)
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        oneofs: dict[str, int] = {}
        for field in fields:
            _field(message, *field, oneofs)
        # proto3 optional's synthetic oneofs must come after the real ones
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tinker_public.{name}"))
            for name in _MESSAGES}


MESSAGES = _build()


class WireError(ValueError):
    """A request body that does not decode as the protocol says (the client's fault: a 400)."""


def tensor_from_proto(t: Any, name: str) -> torch.Tensor:
    """A `Tensor` message as a torch tensor (float32 or int64); sparse (CSR) tensors are 2-D."""
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: dtype {t.dtype} is not float32, int64 or int32")
    shape = tuple(int(s) for s in t.shape)
    if t.WhichOneof("encoding") == "sparse_csr":
        values = np.frombuffer(t.sparse_csr.values, dtype)
        crow = np.frombuffer(t.sparse_csr.crow_indices, np.int64)
        col = np.frombuffer(t.sparse_csr.col_indices, np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise WireError(f"loss_fn_inputs[{name!r}]: a sparse tensor of shape {list(shape)} with "
                            f"{len(crow)} row pointers and {len(values)} values does not fit")
        dense = np.zeros(shape, dtype)
        for row in range(shape[0]):
            cols = col[crow[row]:crow[row + 1]]
            if len(cols) and (cols.min() < 0 or cols.max() >= shape[1]):
                raise WireError(f"loss_fn_inputs[{name!r}]: a column index outside [0, {shape[1]})")
            dense[row, cols] = values[crow[row]:crow[row + 1]]
        return torch.from_numpy(dense)
    flat = np.frombuffer(t.dense, dtype)
    if int(np.prod(shape, dtype=np.int64)) != flat.size:
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {list(shape)} does not hold its {flat.size} values")
    out = torch.from_numpy(flat.reshape(shape).copy())
    return out.long() if t.dtype == DTYPE_INT32 else out


def tokens_of(chunks: Any, where: str) -> list[int]:
    """The token ids of a model input's chunks (text chunks only: an image is refused)."""
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(f"{where}: chunk {i} is not encoded text (image and dmel inputs are not served)")
        tokens += np.frombuffer(chunk.encoded_text.tokens, np.int32).tolist()
    return tokens


def decode_forward_backward(body: bytes) -> Any:
    """A ForwardBackwardRequest message from its bytes."""
    message = MESSAGES["ForwardBackwardRequest"]()
    try:
        message.ParseFromString(body)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends: the body's fault
        raise WireError(f"the forward_backward body is not a tinker_public.ForwardBackwardRequest: {err}") from None
    return message


def loss_config_of(message: Any) -> dict[str, float]:
    """loss_fn_config as numbers (v2 first, the legacy map otherwise); a text value is refused."""
    config = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config.{key}={value.text!r}: the built-in losses take numbers only")
        config[key] = float(value.number)
    return config


def encode_forward_backward(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord of the data's outputs (each a 1-D float32 tensor per
    datum: logprobs, elementwise_loss) and the metrics."""
    message = MESSAGES["ForwardBackwardOutput"](loss_fn_output_type="ArrayRecord")
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in (outputs[0] if outputs else {}):
        arrays = [o[name].detach().float().numpy().astype("<f4") for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
        field = record.fields[name]
        field.data, field.offsets, field.dtype = b"".join(a.tobytes() for a in arrays), offsets.tobytes(), DTYPE_FLOAT32
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    return message.SerializeToString()


def encode_sample(sequences: list[tuple[list[int], list[float], str]],
                  prompt_logprobs: list[float | None] | None = None) -> bytes:
    """SampleResponse: each sequence's tokens (int32), log-probs (float32) and stop reason
    ("stop" or "length"); the prompt's log-probs when asked (NaN where there is none: the first)."""
    message = MESSAGES["SampleResponse"]()
    for tokens, logprobs, reason in sequences:
        message.sequences.add(stop_reason=0 if reason == "stop" else 1,
                              tokens=np.asarray(tokens, "<i4").tobytes(), logprobs=np.asarray(logprobs, "<f4").tobytes())
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray([np.nan if v is None else v for v in prompt_logprobs], "<f4").tobytes()
    return message.SerializeToString()
