"""Config dataclasses as command-line flags: a field declared with `option` is a flag of the same name
(`add_arguments`), read back with `from_args`."""
from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Sequence
from dataclasses import field, fields
from typing import Any

import torch


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None,
           parse: Callable[[str], Any] | None = None, aliases: Sequence[str] = (), metavar: str | None = None,
           group: str | None = None) -> Any:
    """A config field that is also a command-line flag (see `add_arguments`): `--name-with-dashes`, plus
    `aliases`; `parse` turns the flag's text into the value (default: from the annotation)."""
    meta = dict(help=help, choices=tuple(choices) if choices is not None else None, parse=parse,
                aliases=tuple(aliases), metavar=metavar, group=group)
    return field(default=default, metadata=meta)


def check_choices(config: Any) -> None:
    """ValueError unless every field with `choices` holds one of them (or None where None is the default)."""
    for f in fields(config):
        choices, value = f.metadata.get("choices"), getattr(config, f.name)
        if choices is None or value in choices or isinstance(value, torch.dtype):
            continue
        if value is None and f.default is None:
            continue
        raise ValueError(f"{f.name} must be one of {list(choices)}{' or None' if f.default is None else ''}, "
                         f"got {value!r}.")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type, only: Sequence[str] | None = None,
                  exclude: Sequence[str] = (), overrides: dict[str, dict[str, Any]] | None = None) -> None:
    """Add one flag per `option` field of the dataclass `cls` (`only` / `exclude` by field name): default the field
    default, bool fields as --flag / --no-flag, `list[...] | None` fields repeatable. `overrides[name]` replaces
    add_argument keywords of one flag. Fields with a `group` go into the argument group of that title."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {g.title: g for g in parser._action_groups}  # one group per title, across classes
    for f in fields(cls):
        if (only is not None and f.name not in only) or f.name in exclude or "help" not in f.metadata:
            continue
        meta = f.metadata
        default = f.default
        kw: dict[str, Any] = dict(default=default, help=meta["help"], dest=f.name)
        kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        if kinds == [bool]:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kinds[0]) is list:
            kw.update(action="append", type=meta["parse"] or typing.get_args(kinds[0])[0])
        else:
            kw["type"] = meta["parse"] or (kinds[0] if len(kinds) == 1 and kinds[0] in (int, float) else str)
        if meta["choices"] is not None:
            kw["choices"] = meta["choices"]
        if meta["metavar"] is not None:
            kw["metavar"] = meta["metavar"]
        if default is not None and default is not False and default != "" and kw.get("action") != "append":
            kw["help"] += " (default: %(default)s)"
        kw.update((overrides or {}).get(f.name, {}))
        target = parser
        if meta["group"]:
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_argument_group(meta["group"])
            target = groups[meta["group"]]
        target.add_argument(flag_name(f.name), *meta["aliases"], **kw)


def from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` that `args` holds, as keyword arguments."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
