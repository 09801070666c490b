"""``DatasetSpec``: the JSON-able description of a dataset written by the writer.

The spec is the contract between the driver (which writes Parquet shards) and the
workers (which read them): column shapes and dtypes, row counts per split and the
file lists. It holds only plain values so it pickles and round-trips through JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from hvd_spark.errors import ConfigError

SPEC_VERSION = 1
#: The boolean column that marks a validation row, in the rows that go to the ranks (the
#: writer's input, the direct path's shares).
IS_VAL = "__hvd_spark_is_val"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class ColumnSpec:
    """One feature, label or weight column as the reader yields it.

    Attributes:
        name: Column name.
        dtype: numpy dtype name of the values (``"float32"``, ``"int64"``, ...).
        shape: Shape of one row's value: ``()`` for scalars, ``(n,)`` for arrays/vectors.
        kind: ``"scalar"``, ``"array"`` or ``"vector"`` (a Spark ML Vector, stored dense).
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    kind: str = "scalar"


@dataclass(frozen=True)
class SplitSpec:
    """The Parquet files of one split and how many rows they hold.

    Attributes:
        files: File paths relative to the dataset's ``root_url``.
        num_rows: Total rows over all files.
        file_rows: Rows per file, same order as ``files``.
    """

    files: tuple[str, ...] = ()
    num_rows: int = 0
    file_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class DatasetSpec:
    """What the writer produced and the reader needs.

    Attributes:
        key: Cache key of the dataset (a hex digest; see ``hvd_spark.data.writer``).
        root_url: URL (or local path) of the dataset directory; file paths are relative to it.
        columns: Every stored column, features first, then labels, then the weight column.
        feature_cols: Names of the feature columns.
        label_cols: Names of the label columns.
        sample_weight_col: Name of the per-row weight column, if any.
        train: The training split.
        val: The validation split (empty when no validation was asked for).
        settings: The writer settings that went into the cache key (for humans and checks).
        version: Format version of this spec.
    """

    key: str
    root_url: str
    columns: tuple[ColumnSpec, ...]
    feature_cols: tuple[str, ...]
    label_cols: tuple[str, ...] = ()
    sample_weight_col: str | None = None
    train: SplitSpec = field(default_factory=SplitSpec)
    val: SplitSpec = field(default_factory=SplitSpec)
    settings: dict[str, Any] = field(default_factory=dict)
    version: int = SPEC_VERSION

    @property
    def column_names(self) -> list[str]:
        """All stored column names, in spec order."""
        return [c.name for c in self.columns]

    def column(self, name: str) -> ColumnSpec:
        """Return the spec of column ``name``; ConfigError naming the known ones otherwise."""
        for col in self.columns:
            if col.name == name:
                return col
        raise ConfigError(
            f"column {name!r} is not in dataset {self.key}; it has: {', '.join(self.column_names)}"
        )

    def split(self, name: str) -> SplitSpec:
        """Return split ``"train"`` or ``"val"``."""
        if name not in SPLITS:
            raise ConfigError(f"split must be one of {SPLITS}, got {name!r}")
        return self.train if name == "train" else self.val

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists instead of tuples), ready for ``json.dumps``."""
        return asdict(self)

    def to_json(self) -> str:
        """JSON text of the spec."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetSpec:
        """Inverse of ``to_dict``."""
        if data.get("version") != SPEC_VERSION:
            raise ConfigError(
                f"dataset spec version {data.get('version')!r} is not supported "
                f"(expected {SPEC_VERSION}); delete the dataset directory to rewrite it"
            )
        columns = tuple(
            ColumnSpec(c["name"], c["dtype"], tuple(c["shape"]), c["kind"]) for c in data["columns"]
        )

        def split(d: dict[str, Any]) -> SplitSpec:
            return SplitSpec(tuple(d["files"]), int(d["num_rows"]), tuple(d["file_rows"]))

        return cls(
            key=data["key"],
            root_url=data["root_url"],
            columns=columns,
            feature_cols=tuple(data["feature_cols"]),
            label_cols=tuple(data["label_cols"]),
            sample_weight_col=data.get("sample_weight_col"),
            train=split(data["train"]),
            val=split(data["val"]),
            settings=dict(data.get("settings", {})),
            version=data["version"],
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> DatasetSpec:
        """Inverse of ``to_json``."""
        return cls.from_dict(json.loads(text))
