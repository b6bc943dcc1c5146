"""Wire encodings of KServe/Triton tensors <-> numpy: raw bytes (binary extension, gRPC raw contents),
JSON `data`, and the generate extension's JSON values (PROTOCOL §2.1, §3, §4). Errors are ValueErrors
naming the tensor."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

NP_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}


def check_datatype(name: str, datatype: Any) -> str:
    if not isinstance(datatype, str) or datatype not in NP_DTYPES:
        raise ValueError(
            f"{name}: unsupported datatype {datatype!r} (expected one of {', '.join(NP_DTYPES)})"
        )
    return datatype


def check_shape(name: str, shape: Any) -> list[int]:
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(f"{name}: shape must be a list of non-negative integers, got {shape!r}")
    return [int(d) for d in shape]


def datatype_of(arr: np.ndarray) -> str:
    if arr.dtype == np.object_:
        return "BYTES"
    for name, dtype in NP_DTYPES.items():
        if dtype is not np.object_ and arr.dtype == np.dtype(dtype):
            return name
    raise TypeError(f"no Triton datatype for numpy dtype {arr.dtype}")


# ---- raw bytes ------------------------------------------------------------------------------
def serialize_bytes(arr: np.ndarray) -> bytes:
    """BYTES tensor -> for each element (row-major) a uint32 little-endian length, then the bytes."""
    parts = []
    for item in arr.reshape(-1):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(name: str, buf: bytes | memoryview) -> list[bytes]:
    items, view, pos = [], memoryview(buf), 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise ValueError(f"{name}: truncated BYTES element length at offset {pos}")
        (n,) = struct.unpack_from("<I", view, pos)
        pos += 4
        if pos + n > len(view):
            raise ValueError(f"{name}: BYTES element of {n} bytes runs past the end of the data")
        items.append(bytes(view[pos : pos + n]))
        pos += n
    return items


def to_raw(arr: np.ndarray) -> bytes:
    if arr.dtype == np.object_:
        return serialize_bytes(arr)
    return np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def from_raw(name: str, datatype: str, shape: list[int], raw: bytes | memoryview) -> np.ndarray:
    """Raw tensor bytes (binary extension / gRPC raw_input_contents) -> array of `shape`."""
    count = int(np.prod(shape, dtype=np.int64))
    if datatype == "BYTES":
        items = deserialize_bytes(name, raw)
        if len(items) != count:
            raise ValueError(
                f"{name}: shape {shape} needs {count} BYTES elements, got {len(items)}"
            )
        out = np.empty(count, dtype=np.object_)
        out[:] = items
        return out.reshape(shape)
    dtype = np.dtype(NP_DTYPES[datatype]).newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise ValueError(
            f"{name}: shape {shape} of {datatype} needs {count * dtype.itemsize} bytes, "
            f"got {len(raw)}"
        )
    return (
        np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=False).reshape(shape)
    )


# ---- JSON `data` (KServe REST) -------------------------------------------------------------------
def _flatten(name: str, data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def check_json_value(name: str, datatype: str, value: Any) -> Any:
    """One JSON element of a tensor: strings for BYTES, true/false for BOOL, integers for INT/UINT."""
    if datatype == "BYTES":
        if not isinstance(value, str):
            raise ValueError(f"{name}: BYTES elements must be JSON strings, got {value!r}")
        return value.encode("utf-8")
    if datatype == "BOOL":
        if not isinstance(value, bool):
            raise ValueError(f"{name}: BOOL elements must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: {datatype} elements must be JSON numbers, got {value!r}")
    if datatype.startswith(("INT", "UINT")):
        if not isinstance(value, int):
            raise ValueError(f"{name}: {datatype} elements must be JSON integers, got {value!r}")
        info = np.iinfo(NP_DTYPES[datatype])
        if not info.min <= value <= info.max:
            raise ValueError(f"{name}: {value} is out of range for {datatype}")
    return value


def from_json(name: str, datatype: str, shape: list[int], data: Any) -> np.ndarray:
    flat = [check_json_value(name, datatype, v) for v in _flatten(name, data)]
    count = int(np.prod(shape, dtype=np.int64))
    if len(flat) != count:
        raise ValueError(f"{name}: shape {shape} needs {count} elements, got {len(flat)}")
    if datatype == "BYTES":
        out = np.empty(count, dtype=np.object_)
        out[:] = flat
        return out.reshape(shape)
    return np.array(flat, dtype=NP_DTYPES[datatype]).reshape(shape)


def to_json(arr: np.ndarray) -> list:
    """Flat row-major list; BYTES as str (utf-8, undecodable bytes replaced)."""
    if arr.dtype == np.object_:
        return [
            x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
            for x in arr.reshape(-1)
        ]
    return arr.reshape(-1).tolist()


# ---- the generate extension (PROTOCOL §2.1) ------------------------------------------------------
def generate_shape(name: str, metadata_shape: list[int], count: int) -> list[int]:
    """Distribute `count` elements over a metadata shape (leading -1 = batch), innermost dim first."""
    shape, remaining = list(metadata_shape), count
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] >= 0:
            if shape[i] == 0 or remaining % shape[i]:
                raise ValueError(
                    f"The schema can not convert input '{name}' to tensor with proper shape"
                )
            remaining //= shape[i]
    free = [i for i, d in enumerate(shape) if d < 0]
    for k, i in enumerate(reversed(free)):
        shape[i] = remaining if k == 0 else 1
    if not free and remaining != 1:
        raise ValueError(f"The schema can not convert input '{name}' to tensor with proper shape")
    return shape


def from_generate_value(name: str, datatype: str, dims: tuple[int, ...], value: Any) -> np.ndarray:
    """A JSON scalar or 1-D array -> tensor of shape [batch] + dims (`[]` -> an empty tensor)."""
    if isinstance(value, list):
        if any(isinstance(v, (list, dict)) for v in value):
            raise ValueError(
                f"{name}: generate accepts a JSON scalar or a 1-D array, got a nested value"
            )
        values = value
    elif isinstance(value, dict) or value is None:
        raise ValueError(f"{name}: generate accepts a JSON scalar or a 1-D array, got {value!r}")
    else:
        values = [value]
    if not values:
        return np.empty([0], dtype=NP_DTYPES[datatype])
    shape = generate_shape(name, [-1, *dims], len(values))
    return from_json(name, datatype, shape, values)


# ---- image tensor layouts -------------------------------------------------------------------------
def image_arrays(name: str, pixels: np.ndarray, sizes: np.ndarray | None) -> list[np.ndarray]:
    """[N, H, W, C] or [N, C, H, W] uint8 -> N HxWxC arrays, cropped to image_sizes_input (pixtral padding)."""
    if pixels.ndim != 4:
        raise ValueError(
            f"{name}: expected [batch, num_images, H, W, C] or [batch, num_images, C, H, W] pixels, "
            f"got {pixels.ndim + 1}-D"
        )
    if pixels.shape[-1] not in (1, 3, 4) and pixels.shape[1] in (1, 3, 4):
        pixels = pixels.transpose(0, 2, 3, 1)
    images = list(pixels)
    if sizes is not None:
        sizes = sizes.reshape(-1, 2)
        if len(sizes) != len(images):
            raise ValueError(f"image_sizes_input: {len(sizes)} sizes for {len(images)} images")
        images = [im[: max(int(h), 1), : max(int(w), 1)] for im, (h, w) in zip(images, sizes)]
    return images


def pixel_values(arr: np.ndarray) -> torch.Tensor:
    """image_input [N, C, H, W] or [N, H, W, C] (already preprocessed; one picture: [3, H, W]) -> float32
    [N, 3, H, W]."""
    if arr.ndim == 3 and arr.shape[0] == 3:
        arr = arr[None]
    if arr.ndim != 4:
        raise ValueError(
            f"image_input: expected [batch, num_images, C, H, W] preprocessed pixels, "
            f"got {arr.ndim + 1}-D"
        )
    if arr.shape[1] != 3 and arr.shape[-1] == 3:
        arr = arr.transpose(0, 3, 1, 2)
    if arr.shape[1] != 3:
        raise ValueError(
            f"image_input: expected 3 channels, got shape {list(arr.shape)} per batch item"
        )
    pv = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    if not torch.isfinite(pv).all():
        raise ValueError("image_input: contains NaN or infinite values")
    return pv
