"""Bytes per element of the dtypes a captured graph names (a leaf: the memory and fusion models read it)."""

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 2)
