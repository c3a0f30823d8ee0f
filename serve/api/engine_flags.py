"""The engine's command-line flags, built from the config fields that declare them.

Each engine setting is a field of a config class in serve/config.py (`setting(...)`); here
each becomes `--its-name`, in a group per config class, typed from the field's annotation:

    bool                       --name / --no-name (BooleanOptionalAction)
    a union with str           the text as given (the config reads it: `--kv-cache-memory 4GiB`)
    int, float (or None)       that type; argparse rejects other text (exit 2)

Values argparse cannot judge (a block size that is not a power of two) are judged when the
config is built, by the same checks as `LLM(...)`'s, as InvalidSettingError.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from serve.config import EngineConfig, InvalidSettingError, Setting, engine_settings
from serve.vllm_arguments import VLLM_ARGUMENTS


def add_engine_flags(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Add every engine setting's flag to `parser`; the groups by title (so that the CLI
    can add its own flags beside them, e.g. `--served-model-name` under "model")."""
    groups: dict[str, Any] = {}
    for setting in engine_settings():
        if setting.title not in groups:
            groups[setting.title] = parser.add_argument_group(setting.title)
        flag = setting.flag
        shown = {"choices": flag.choices, "metavar": flag.metavar}
        groups[setting.title].add_argument(
            setting.option,
            *flag.aliases,
            dest=setting.name,
            default=setting.default,
            help=flag.help,
            **{key: value for key, value in shown.items() if value is not None},
            **_value_kwargs(setting),
        )
    vllm = parser.add_argument_group("vLLM's engine arguments serve has no setting for")
    for argument in VLLM_ARGUMENTS:
        kind = {"action": "store_true"} if argument.kind is bool else {"metavar": "VALUE"}
        vllm.add_argument(argument.option, dest=argument.name, help=argument.help, **kind)
    return groups


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig a parsed command line asks for: the same as
    `EngineConfig.create(**{name: value})` with the same settings."""
    names = [s.name for s in engine_settings()] + [a.name for a in VLLM_ARGUMENTS]
    return EngineConfig.create(**{name: getattr(args, name) for name in names})


def flag_error(error: InvalidSettingError) -> str:
    """`error` as argparse words its own: `argument --block-size: must be ...`."""
    options = {s.name: s.option for s in [*engine_settings(), *VLLM_ARGUMENTS]}
    return f"argument {options.get(error.name, error.name)}: {error.reason}"


def _value_kwargs(setting: Setting) -> dict[str, Any]:
    value_types = _value_types(setting.annotation)
    if value_types == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if str in value_types:
        return {"type": str}
    if value_types in ({int}, {float}):
        return {"type": value_types.pop()}
    if value_types == {int, float}:
        return {"type": float}
    raise TypeError(
        f"No command-line form for setting {setting.name} of type {setting.annotation}: "
        "use bool, int, float or str (optionally | None)."
    )


def _value_types(annotation: Any) -> set[type]:
    """The types a field holds, None left out: `int | None` -> {int}."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {arg for arg in typing.get_args(annotation) if arg is not type(None)}
    return {annotation}
