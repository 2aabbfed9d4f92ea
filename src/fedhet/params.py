"""The base of every configuration model, and the one place where a validation failure becomes fedhet's wording.

Every parameter model (the config's sections, and each dataset's, partitioner's, model's, algorithm's and server
optimiser's parameters) derives from :class:`Params`, so a new component gets these rules without asking:

* unknown keys are errors, not silently ignored;
* floats are finite: ``inf`` and ``nan`` (TOML's ``inf``/``nan``, an override ``1e999``, the strings "inf"/"nan")
  are refused, since no parameter gives infinity a meaning;
* a boolean is not a number: ``true`` for an int or float field is refused (pydantic would read it as 1), also
  inside lists and tuples. Ints still fill float fields, and TOML arrays still fill tuple fields.
"""

from __future__ import annotations

import types
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import ErrorDetails

Seed = typing.Annotated[int, Field(ge=0)]  # numpy's generators take any non-negative integer


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # The parameters a tuner may search and their default ranges, ``{"mu": "log:1e-3:1"}``, in the grammar of
    # fedhet.tuning.space (docs/tuning.md, "Search spaces"); each entry commented with its source. Empty: nothing
    # of this model is tuned. A subclass that adds one extends its parent's: ``{**Parent.tunable, ...}``.
    tunable: ClassVar[dict[str, str]] = {}

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        wanted = None if field is None else _bool_for_number(field.annotation, value)
        if wanted is not None:
            if isinstance(value, bool):
                raise ValueError(f"must be {_NAMES[wanted][0]}, not a boolean")
            raise ValueError(f"must be a list of {_NAMES[wanted][1]}, not booleans")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _none_is_a_choice(cls, value: Any, info: ValidationInfo) -> Any:
        # An override's "none" parses to None (the command line's null); where None is not allowed but a choice is
        # named "none" (train.augment, feddyn's alpha_scaling), the user meant that choice.
        field = cls.model_fields.get(info.field_name or "")
        if value is None and field is not None and _names_none(field.annotation):
            return "none"
        return value


def _names_none(tp: Any) -> bool:
    """True for a type without None among its alternatives that has the literal choice "none"."""
    members = _members(tp)
    if type(None) in members:
        return False
    return any(typing.get_origin(m) is typing.Literal and "none" in typing.get_args(m) for m in members)


_NAMES = {int: ("an integer", "integers"), float: ("a number", "numbers")}


def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _members(tp: Any) -> tuple[Any, ...]:
    """The alternatives of a union (``int | None`` -> int, NoneType), else the type itself."""
    tp = _unwrap(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(m for a in typing.get_args(tp) for m in _members(a))
    return (tp,)


def _admits_bool(tp: Any) -> bool:
    for m in _members(tp):
        if m in (bool, Any, object):
            return True
        if typing.get_origin(m) is typing.Literal and any(isinstance(a, bool) for a in typing.get_args(m)):
            return True
    return False


def _bool_for_number(tp: Any, value: Any) -> type | None:
    """The number type (int or float) that ``tp`` wants where ``value`` is, or in a list or tuple holds, a boolean."""
    if isinstance(value, bool):
        if _admits_bool(tp):
            return None
        return next((m for m in _members(tp) if m in (int, float)), None)
    if isinstance(value, list | tuple):
        for m in _members(tp):
            origin, args = typing.get_origin(m), typing.get_args(m)
            if origin not in (list, tuple, set, frozenset) or not args:
                continue
            if origin is tuple and Ellipsis not in args and len(args) == len(value):
                pairs = zip(args, value, strict=True)
            else:
                pairs = ((args[0], v) for v in value)
            return next((t for t in (_bool_for_number(a, v) for a, v in pairs) if t is not None), None)
    return None


# ------------------------------------------------------------------------------------------- error wording

_SECTION_TYPES = ("model_type", "model_attributes_type", "dict_type")


def describe(error: ErrorDetails) -> str:
    """One problem in fedhet's words, without pydantic's "Value error, " or "Input should be" phrasing."""
    kind = error["type"]
    if kind in ("value_error", "assertion_error") and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    if kind in _SECTION_TYPES:
        return "must be a table of keys"
    if kind == "missing":
        return "is required"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "must be an integer"
    if kind in ("float_type", "float_parsing"):
        return "must be a number"
    if kind in ("bool_type", "bool_parsing"):
        return "must be true or false"
    if kind == "string_type":
        return "must be a string"
    if kind in ("list_type", "tuple_type"):
        return "must be a list"
    if kind in ("too_long", "too_short"):
        most = "most" if kind == "too_long" else "least"
        count = error.get("ctx", {}).get(f"{'max' if kind == 'too_long' else 'min'}_length")
        return f"must have at {most} {count} items"
    msg = error["msg"]
    for theirs, ours in (("Input should be", "must be"), ("Input should have", "must have")):
        if msg.startswith(theirs):
            msg = ours + msg[len(theirs) :]
    return msg


def shown(value: Any, limit: int = 80) -> str:
    """``repr`` of a value, cut short so a huge input cannot make a huge message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problem(error: ErrorDetails) -> str:
    """``run.rounds: must be greater than or equal to 1 (got 0)``. A check of a whole section (a model validator)
    speaks for itself: its message names the keys, and neither the section nor all its keys are repeated."""
    loc = ".".join(str(part) for part in error["loc"])
    text = describe(error)
    whole = error["type"] in ("value_error", "assertion_error") and isinstance(error.get("input"), dict)
    if whole or not loc:
        return text
    value = "" if error["type"] == "missing" else f" (got {shown(error.get('input'))})"
    return f"{loc}: {text}{value}"
