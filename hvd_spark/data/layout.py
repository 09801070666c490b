"""How ``write_dataset`` stores columns in Parquet, and how the reader turns them back.

Chosen for decoding speed, since every epoch decodes the files again:

- Every column is *required*: ``write_dataset`` has refused nulls before writing, and
  Parquet then stores no definition levels.
- Arrays and ML Vectors (one fixed length per column, checked before writing) are
  *packed*: each row's values become one fixed-size binary value holding the
  little-endian numbers. Parquet decodes that as a byte copy, where a list column pays
  for repetition and definition levels on every value (784 float32 per row: 0.70 s ->
  0.18 s of CPU per 200k rows). The reader views the bytes as a ``(rows, *shape)`` array
  without copying; the dataset spec gives dtype and shape.
- Row groups hold at most ``ROW_GROUP_BYTES`` (64 MiB): the reader decodes a few at a
  time per rank, so wide rows (images) must not make them gigabytes.
- Floating-point columns get no dictionary pages: continuous values are nearly all
  distinct, so a dictionary only adds a lookup per value (random float32: files 45%
  larger, decoding 60% slower). Integer and boolean columns (labels, ids) keep it.

Files written before packing (list columns) still read: the reader handles both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from hvd_spark.data.spec import ColumnSpec
from hvd_spark.errors import DataError


def pack_arrays(table: pa.Table, columns: Sequence[ColumnSpec]) -> pa.Table:
    """Replace each array/vector column of ``table`` by its packed fixed-size binary form."""
    for spec in columns:
        if spec.kind == "scalar" or spec.name not in table.column_names:
            continue
        index = table.column_names.index(spec.name)
        table = table.set_column(index, spec.name, _pack(table.column(spec.name), spec))
    return table


def _pack(column: pa.ChunkedArray, spec: ColumnSpec) -> pa.Array:
    lists = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    dtype = np.dtype(spec.dtype).newbyteorder("<")
    width = math.prod(spec.shape)
    values = np.ascontiguousarray(lists.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
    if values.size != len(lists) * width:
        raise DataError(  # write_dataset checked the lengths; this guards the packing itself
            f"column {spec.name!r}: {values.size} values for {len(lists)} rows of shape "
            f"{spec.shape}")
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width * dtype.itemsize), len(lists), [None, pa.py_buffer(values)])


# Row groups are the reader's unit of decoding and of memory: a few are held at once
# per rank, so they are kept to this size even when Spark hands over large batches.
ROW_GROUP_BYTES = 64 << 20


def row_group_rows(table: pa.Table) -> int:
    """Rows per Parquet row group for ``table``: all of them, or fewer for wide rows."""
    if table.num_rows == 0:
        return 1
    row_bytes = max(1, table.nbytes // table.num_rows)
    return max(1, min(table.num_rows, ROW_GROUP_BYTES // row_bytes))


def is_packed(data_type: pa.DataType) -> bool:
    """True for a packed array column (fixed-size binary)."""
    return pa.types.is_fixed_size_binary(data_type)


def unpack(array: pa.Array, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only ``(rows, *shape)`` view of a packed column's bytes (no copy)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    width = array.type.byte_width
    if width != math.prod(shape) * dtype.itemsize:
        raise DataError(
            f"column {name!r} holds {width}-byte values, not arrays of shape {shape} of "
            f"{dtype.name}; the dataset spec does not match its files (rewrite the dataset)")
    rows = len(array)
    if rows == 0:
        return np.empty((0, *shape), dtype)
    data = np.frombuffer(array.buffers()[1], dtype, count=rows * math.prod(shape),
                         offset=array.offset * width)
    return data.reshape(rows, *shape)


def storage_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every field and list element marked non-nullable.

    Arrow's cast to this schema refuses a null, so nothing that slipped past the checks
    is written as a wrong value.
    """
    return pa.schema([_required(field) for field in schema], metadata=schema.metadata)


def _required(field: pa.Field) -> pa.Field:
    value_type = field.type
    if pa.types.is_list(value_type):
        value_type = pa.list_(_required(value_type.value_field))
    elif pa.types.is_large_list(value_type):
        value_type = pa.large_list(_required(value_type.value_field))
    elif pa.types.is_fixed_size_list(value_type):
        value_type = pa.list_(_required(value_type.value_field), value_type.list_size)
    return pa.field(field.name, value_type, nullable=False, metadata=field.metadata)


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """Parquet column paths to dictionary-encode: integer and boolean values only."""
    paths = []
    for field in schema:
        # Parquet names a list's values "<name>.list.element", one level per nesting.
        path, value_type = field.name, field.type
        while _is_list(value_type):
            path, value_type = path + ".list.element", value_type.value_type
        if pa.types.is_integer(value_type) or pa.types.is_boolean(value_type):
            paths.append(path)
    return paths


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
