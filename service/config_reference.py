"""The configuration reference (docs/configuration.md), generated from the settings model.

Every key's type, bounds and default come from the pydantic fields of
``service.config``; its description is the attribute docstring written under
the field; its environment variable follows ``ENV_PREFIX``/``ENV_SEPARATOR``.
The refusals (validators) are described here, one text per validator, and
``undocumented()`` names any key or validator without a description, so a
new key cannot reach the docs silently::

    python -m tierckpt.service.config_reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import inspect
import socket
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo

from . import config, worker_settings
from .config import (
    ENV_PREFIX,
    ENV_SEPARATOR,
    FILE_ONLY_SECTIONS,
    BaseModel,
    Settings,
    default_memory_bytes,
    default_memory_dir,
)

# The modules whose models are settings sections (config.py holds or imports
# them all).
SETTINGS_MODULES = (config.__name__, worker_settings.__name__)

# One text per validator, keyed by (model, validator function).
REFUSALS: dict[tuple[str, str], list[str]] = {
    ("ServerSettings", "_base_url"): [
        "`server.advertise_url` must be a base URL `http(s)://host[:port]`, no path.",
    ],
    ("CatalogSettings", "_supported_driver"): [
        "`catalog.url` must start with `sqlite+aiosqlite://` or `postgresql+asyncpg://`.",
    ],
    ("RegionSettings", "_valid_name"): [
        "A region name must match `[A-Za-z0-9._-]{1,128}` and be neither `.` nor `..`.",
    ],
    ("RegionSettings", "_clean_prefix"): [
        "A region `prefix` must not contain empty, `.` or `..` segments "
        "(slashes around it are dropped).",
    ],
    ("RegionSettings", "_kind_fields"): [
        "A region of kind `s3` needs a `bucket`; one of kind `posix` needs a `root`.",
    ],
    ("TokenSettings", "_hex_digest"): [
        "A token's `sha256` must be 64 hexadecimal digits (the SHA-256 of the token).",
    ],
    ("WorkerSettings", "_cpu_list"): [
        "`worker.cpus` must be `auto`, `all` or a CPU list such as `2`, `2-5` or `0,2,4-7` "
        "(numbers up to 65535, ranges that do not end before they start); "
        "a number or an array of numbers is read as the list it spells.",
    ],
    ("WorkerSettings", "_cpus_need_a_process"): [
        "`worker.cpus` as a list only with `worker.separate_process` `auto` or `yes` "
        "(it confines the worker's own process; `auto` confines nothing when the worker "
        "runs in the agent's).",
    ],
    ("Settings", "_safe_combinations"): [
        "At least one `[[regions]]` entry, and region names unique.",
        "`durability.min_regions` at most the number of regions.",
        "`server.host` other than loopback (a `127.0.0.0/8` address, `::1` or `localhost`) "
        "only with `[[tokens]]` configured: the agent never serves a network without them.",
        "`peers.copies` above 0 with `[[tokens]]` configured only with `peers.token` set "
        "(the `peer` token this agent presents to its peers).",
    ],
}

SCALARS: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    Path: "path",
}

# Defaults that depend on the machine are described, not shown.
DESCRIBED_DEFAULTS: dict[Callable[[], Any], str] = {
    socket.gethostname: "the machine's host name",
    default_memory_bytes: "1 GiB, or a quarter of /dev/shm when that is less",
    default_memory_dir: "/dev/shm/tierckpt (.tierckpt/memory without /dev/shm)",
}

HEADER = f"""\
# Configuration

<!-- Generated from service/config.py and service/worker_settings.py by
     `python -m tierckpt.service.config_reference > docs/configuration.md`
     (or `make docs`); tests/unit/test_config_reference.py fails when it is out of date. -->

`tierckpt serve --config FILE` (and `migrate`, `rebuild-catalog`) read one TOML
file. With no file the agent runs on the embedded default: a SQLite catalog
and one POSIX region under `./.tierckpt/`, bound to loopback, no tokens.

- **Unknown keys are refused**, in every table: a misspelt key fails at start
  with its name instead of being ignored.
- **Every key of a table can be overridden from the environment** as
  `{ENV_PREFIX}<SECTION>{ENV_SEPARATOR}<KEY>` (upper case), e.g.
  `{ENV_PREFIX}CATALOG{ENV_SEPARATOR}URL=postgresql+asyncpg://…`. The value is read as
  a TOML literal when it is one (`9000`, `true`, `["/ssd/a", "/ssd/b"]`,
  `{{metric = "val_loss", n = 3}}`), else taken as a string. The environment
  wins over the file.
- {" and ".join(f"`[[{name}]]`" for name in FILE_ONLY_SECTIONS)} are arrays of
  tables and come from the file only.
- A configuration that cannot be used is refused at start with the key and the
  reason (see [Refusals](#refusals)).

An example with two S3 regions, a PostgreSQL catalog and tokens:

```toml
[server]
host = "0.0.0.0"            # needs [[tokens]]
node = "gpu-node-17"

[catalog]
url = "postgresql+asyncpg://tierckpt:secret@db.internal/tierckpt"

[local]
roots = ["/ssd/checkpoints"]

[[regions]]                 # the first region is the primary
name = "us-east"
endpoint_url = "https://s3.us-east-1.amazonaws.com"
bucket = "ckpt-east"
region_name = "us-east-1"

[[regions]]
name = "us-west"
endpoint_url = "https://s3.us-west-2.amazonaws.com"
bucket = "ckpt-west"
region_name = "us-west-2"

[durability]
min_regions = 1

[[tokens]]
name = "trainers"
sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
role = "trainer"
runs = "llama-*"

[retention]
keep_last = 5
keep_best = {{metric = "val_loss", mode = "min", n = 2}}
```
"""


def attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the docstring written under it (inherited fields included)."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        if cls.__module__ not in SETTINGS_MODULES:
            continue
        (tree,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
        assert isinstance(tree, ast.ClassDef)
        for field, after in zip(tree.body, [*tree.body[1:], None], strict=True):
            if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
                continue
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the model a field holds, whether it is an array of them)."""
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, True
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate, False
    return None, False


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " or ".join(f'`"{value}"`' for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in typing.get_args(annotation) if a is not type(None)]
        return " or ".join(names) + ", optional"
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"list of {_type_name(item)}s"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    return SCALARS[annotation]


# Constraint type, its attribute, and how the reference writes it.
BOUND_WORDING = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.MinLen, "min_length", "length ≥"),
    (annotated_types.MaxLen, "max_length", "length ≤"),
)


def _bounds(field: FieldInfo) -> list[str]:
    bounds = []
    for item in field.metadata:
        for kind, attribute, words in BOUND_WORDING:
            if isinstance(item, kind):
                bounds.append(f"{words} {getattr(item, attribute)}")
                break
        else:
            raise TypeError(f"no wording for the constraint {item!r}")
    return bounds


def _toml(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | Path):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, BaseModel):
        items = value.model_dump(exclude_defaults=True)
        return "{" + ", ".join(f"{key} = {_toml(item)}" for key, item in items.items()) + "}"
    return str(value)


def _default_value(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def _default(name: str, field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory in DESCRIBED_DEFAULTS:
        return DESCRIBED_DEFAULTS[field.default_factory]
    value = _default_value(field)
    text = f"`{_toml(value)}`" if value is not None else "unset"
    if "bytes" in name and isinstance(value, int) and value and value % 1024**2 == 0:
        mib = value // 1024**2
        text += f" ({mib // 1024} GiB)" if mib % 1024 == 0 else f" ({mib} MiB)"
    return text


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _keys(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, FieldInfo, str]]:
    """(dotted key, name, field, description) of every key of a table, nested
    tables flattened after the key that holds them."""
    docs = attribute_docs(model)
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", name, field, docs.get(name, "")
        nested, _array = _model_of(field.annotation)
        if nested is not None:
            yield from _keys(nested, prefix=f"{prefix}{name}.")


def _row(section: str, key: str, name: str, field: FieldInfo, doc: str, env: bool) -> str:
    env_name = f"`{ENV_PREFIX}{section.upper()}{ENV_SEPARATOR}{name.upper()}`"
    cells = [
        f"`{key}`",
        _cell(", ".join([_type_name(field.annotation), *_bounds(field)])),
        _cell(_default(name, field)),
        env_name if env and "." not in key else "—",
        _cell(doc),
    ]
    return "| " + " | ".join(cells) + " |"


def _sections() -> Iterator[tuple[str, type[BaseModel], bool, FieldInfo]]:
    for section, field in Settings.model_fields.items():
        model, array = _model_of(field.annotation)
        assert model is not None, f"Settings.{section} is not a table"
        yield section, model, array, field


def undocumented() -> list[str]:
    """Keys without an attribute docstring and validators without a refusal text."""
    missing = []
    for section, model, _array, _field in _sections():
        missing += [f"{section}.{key}" for key, _name, _field, doc in _keys(model) if not doc]
    described = set(REFUSALS)
    present = set(validators())
    missing += [f"validator {owner}.{name}" for owner, name in sorted(present - described)]
    missing += [f"refusal text of a gone validator {o}.{n}" for o, n in sorted(described - present)]
    return missing


def validators() -> list[tuple[str, str]]:
    """(model, function) of every validator defined in the settings modules."""
    found = []
    for owner in vars(config).values():
        if not (isinstance(owner, type) and issubclass(owner, BaseModel)):
            continue
        if owner.__module__ not in SETTINGS_MODULES:
            continue
        decorators = owner.__pydantic_decorators__
        for name in [*decorators.field_validators, *decorators.model_validators]:
            if name in vars(owner):
                found.append((owner.__name__, name))
    return found


def render() -> str:
    lines = [HEADER]
    head = "| key | type | default | environment | description |\n| --- | --- | --- | --- | --- |"
    for section, model, array, field in _sections():
        title = f"[[{section}]]" if array else f"[{section}]"
        lines.append(f"## `{title}`\n")
        if model.__doc__:
            lines.append(inspect.cleandoc(model.__doc__) + "\n")
        if array:
            shown = ", ".join(f"`{_toml(entry)}`" for entry in _default_value(field)) or "none"
            lines.append(f"An array of tables, from the file only. Default: {shown}.\n")
        lines.append(head)
        lines += [_row(section, *key, env=not array) for key in _keys(model)]
        lines.append("")
    lines.append("## Refusals\n")
    lines.append(
        "Besides unknown keys and the bounds and choices in the tables above, "
        "the agent refuses, at start and with the reason, a configuration that "
        "breaks one of these rules:\n"
    )
    for texts in REFUSALS.values():
        lines += [f"- {text}" for text in texts]
    lines.append(
        "- The file exists and is valid TOML, and an environment variable "
        f"`{ENV_PREFIX}<SECTION>{ENV_SEPARATOR}<KEY>` names a section the file "
        "leaves unset or sets to a table."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
