"""The reference of every config key (docs/config.md, ``fedhet list config``), generated from the models themselves:
each key's type and default from pydantic, its description from the comments beside it in the source, so it cannot
drift from the code (tests/test_cli_consistency.py compares docs/config.md with ``config_markdown()``). Above the
config and the registries: the component parameters come from every registered component."""

from __future__ import annotations

import ast
import json
from typing import Any

from fedhet.components import component_registries
from fedhet.config import Config
from fedhet.params import Params


def _field_comments(model: type) -> dict[str, str]:
    """field name -> the comment above it (its own lines) and the one after it, from the source of ``model`` and
    the classes it derives from (a subclass's comment wins)."""
    import inspect
    import textwrap

    out: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if cls.__module__.startswith(("pydantic", "builtins")) or cls is Params:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        tree = ast.parse(source)
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node in body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            above = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            last = lines[node.end_lineno - 1]
            after = last.split("  # ", 1)[1].strip() if "  # " in last else ""
            text = " ".join(part for part in (" ".join(above), after) if part)
            if text:
                out[node.target.id] = text
    return out


def _type_name(tp: Any) -> str:
    import typing

    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is not None:
        args = [a for a in typing.get_args(tp)]
        name = getattr(origin, "__name__", str(origin))
        if name in ("Union", "UnionType"):
            return " | ".join(_type_name(a) for a in args)
        return f"{name}[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _default_text(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default is PydanticUndefined and field.default_factory is None:
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, Params):
        return "(section)"
    return json.dumps(value) if value is None or isinstance(value, bool | str | list | tuple) else repr(value)


_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "length ≥"))


def _bounds(field: Any) -> str:
    """`` ≥ 1`` / `` > 0, ≤ 1``: the limits pydantic checks (Field(ge=..., ...))."""
    out = []
    for item in field.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
    return f" ({', '.join(out)})" if out else ""


def _model_rows(prefix: str, model: type, skip: tuple[str, ...] = ()) -> list[tuple[str, str, str, str]]:
    comments = _field_comments(model)
    return [
        (f"{prefix}{name}", _type_name(field.annotation) + _bounds(field), _default_text(field), comments.get(name, ""))
        for name, field in model.model_fields.items()
        if name not in skip
    ]


def config_rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) of every section key of the config (``run.rounds``, ...)."""
    rows = []
    for section, field in Config.model_fields.items():
        rows += _model_rows(f"{section}.", field.annotation)
    return rows


def component_rows() -> list[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """(section, component name, rows) of every registered component's own parameters (``algorithm.mu`` when
    ``algorithm.name = "fedprox"``), plug-ins loaded in this process included."""
    out = []
    for section, registry in component_registries():
        for entry in registry.entries():
            if entry.params is not None and entry.params.model_fields:
                out.append((section, entry.name, _model_rows(f"{section}.", entry.params)))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_markdown() -> str:
    """docs/config.md: every section key, then every built-in component's parameters (as loaded in this process)."""

    def table(rows: list[tuple[str, str, str, str]]) -> list[str]:
        out = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        out += [f"| `{k}` | {_cell(t)} | `{_cell(d)}` | {_cell(c)} |" for k, t, d, c in rows]
        return out

    lines = [
        "# Config reference",
        "",
        "<!-- Generated by `fedhet list config --markdown > docs/config.md`; do not edit by hand: "
        "tests/test_cli_consistency.py fails when it differs from the code. -->",
        "",
        "Every key a TOML file (`[section]` tables), an override (`-s section.key=value`) or a Python dict",
        '(`{"section": {"key": value}}`) can set. Unknown keys are errors. Relative paths: the plug-in files a TOML',
        "file names (`run.plugins`) are taken from the TOML file's folder (so a config and its plug-in move together);",
        "`run.out_dir`, `dataset.data_dir` and the `[tracking]` folders from the working directory (a run's outputs go",
        "where it is started; a Flower app's on the SuperLink). `-s`, `--plugin` and Python values: the working",
        "directory.",
        "A component section (`dataset`, `partition`, `features`, `model`, `algorithm`, `server`) also takes the",
        "parameters of the component its `name` picks; they are listed after the sections (`fedhet list algorithms`",
        "shows them too).",
        "",
    ]
    for section, field in Config.model_fields.items():
        lines += [f"## [{section}]", "", *table(_model_rows(f"{section}.", field.annotation)), ""]
    lines += ["# Component parameters", ""]
    for section, name, rows in component_rows():
        lines += [f'## {section}.name = "{name}"', "", *table(rows), ""]
    return "\n".join(lines)
