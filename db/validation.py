"""One validation of a row before it is stored, used by the sweep writer and by ``kvleague db import``.

Each table of ``db.models`` gets a pydantic model made from its columns, so the checks follow the
schema: integers within the column's width (32-bit ``Integer``, 64-bit ``BigInteger``: what PostgreSQL
holds, enforced on SQLite too), finite floats (NaN and Inf are refused on both backends: PostgreSQL's
JSON refuses them and SQLite would turn a NaN float into NULL), strict booleans, ISO datetimes, text
within its width and valid Unicode, JSON of finite numbers. NUL is allowed only in free-text columns
(``models.FreeText``, which stores it escaped); elsewhere it is refused, since PostgreSQL refuses it.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from functools import cache
from typing import Annotated, Any, Optional

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    create_model,
)
from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Integer, String, Table

from kvleague.db.models import Base, FreeText, escape_text

#: the longest line an export may hold (a row with a long completion is well under it): a longer one is
#: refused after reading this much, whatever its size
MAX_LINE_BYTES = 16 * 1024 * 1024
_INT32, _INT64 = 2**31, 2**63


class RowError(ValueError):
    """A row that may not be stored: ``field`` (``table.column``) and why, in one line."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode (a lone surrogate at character {exc.start})") from None
    return value


def _text(width: int | None, free: bool):
    """The check of a text column: valid Unicode; NUL only in free text (stored escaped); at most
    ``width`` characters as stored."""

    def check(value: str) -> str:
        _unicode(value)
        if not free and "\x00" in value:
            raise ValueError(f"contains NUL at character {value.index(chr(0))} (allowed only in free text)")
        if width and len(escape_text(value) if free else value) > width:
            raise ValueError(f"longer than {width} characters")
        return value

    return AfterValidator(check)


def _json(value: Any) -> Any:
    """JSON of finite numbers and valid Unicode (what both databases store and an export carries)."""
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds text that is not valid Unicode (a lone surrogate)") from None
    except ValueError:
        raise ValueError("holds NaN or Infinity, which are not JSON") from None
    except TypeError as exc:
        raise ValueError(f"is not JSON ({exc})") from None
    except RecursionError:
        raise ValueError("is nested too deeply") from None
    return value


def _finite(value: int | float) -> float:
    try:
        number = float(value)
    except OverflowError:
        raise ValueError("too large for a float") from None
    if not math.isfinite(number):
        raise ValueError("NaN and Infinity are not stored")
    return number


def _iso(value: Any) -> Any:
    # an export holds datetimes as ISO text; a number is refused (no guessing of epochs)
    return datetime.fromisoformat(value) if isinstance(value, str) else value


def _field_type(column) -> Any:
    t = column.type
    if isinstance(t, FreeText):
        return Annotated[str, Field(strict=True), _text(getattr(t.impl_instance, "length", None), free=True)]
    if isinstance(t, Boolean):
        return StrictBool
    if isinstance(t, (BigInteger, Integer)):
        bound = _INT64 if isinstance(t, BigInteger) else _INT32
        return Annotated[StrictInt, Field(ge=-bound, lt=bound)]
    if isinstance(t, Float):
        return Annotated[StrictFloat | StrictInt, AfterValidator(_finite)]
    if isinstance(t, DateTime):
        return Annotated[datetime, BeforeValidator(_iso), Field(strict=True)]
    if isinstance(t, String):  # Text too
        return Annotated[str, Field(strict=True), _text(t.length, free=False)]
    if isinstance(t, JSON):
        return Annotated[Any, AfterValidator(_json)]
    raise TypeError(f"db.validation: no check for {column.table.name}.{column.name} of type {t!r}")


@cache
def row_model(table_name: str) -> type[BaseModel]:
    """The pydantic model of one row of ``table_name``: extra keys are refused; a column that is not
    nullable and has no default is required; ``id`` may be left out (the database numbers new rows)."""
    table: Table = Base.metadata.tables[table_name]
    fields: dict[str, Any] = {}
    for column in table.columns:
        kind = _field_type(column)
        if column.nullable:
            fields[column.name] = (Optional[kind], None)  # noqa: UP045 (an Annotated type)
        elif column.primary_key or column.default is not None or column.server_default is not None:
            fields[column.name] = (kind, None)  # a default is not validated; an explicit None is refused
        else:
            fields[column.name] = (kind, ...)
    return create_model(f"{table_name}_row", __config__=ConfigDict(extra="forbid"), **fields)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_row(table_name: str, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` checked against ``table_name``'s columns; returns the values to store (datetimes parsed,
    integers of float columns as floats), only the keys given. Raises ``RowError`` on the first fault."""
    try:
        model = row_model(table_name)
    except KeyError:
        raise RowError("table", f"unknown table {table_name!r}") from None
    try:
        checked = model.model_validate(row)
        return {name: checked.__dict__[name] for name in checked.model_fields_set}
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        column = ".".join(str(p) for p in first["loc"][:1]) or "row"
        reason = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            reason = "not a column of this table"
        elif first["type"] != "missing":
            reason += f" (got {_shown(first.get('input'))})"
        raise RowError(f"{table_name}.{column}", reason) from None
