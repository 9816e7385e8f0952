"""The checks of the frozen launch configurations: ``kernels.permute.PermuteLaunch`` and
``GatherLaunch``, ``kernels.quantize.NVFP4Launch``, ``BlockLaunch`` and ``AmaxLaunch``,
``kernels.routing.RoutingLaunch``.

Each class is declared with :func:`checked_launch` (a frozen dataclass with a
``__post_init__``): a field of the wrong type or out of its range is refused where the config
is made, naming the class, the field and the value, instead of where (and whether) a launch
reads it. So every face of an op sees the same valid configs: the eager launch, and the
registered op, whose schema takes the fields one by one (a ``bool`` field given 1 or "no"
would otherwise be read as true by one and refused by the other).

- Type (TypeError): a field annotated ``bool``, ``int`` or ``str`` (or ``Optional`` of one)
  takes only that type (a bool is not an int here) or None where optional. A symbolic value
  (``torch.SymInt``, ``torch.SymBool``, as a config rebuilt inside a trace may hold) passes;
  its range is not checked.
- Range (ValueError): ``positive`` fields are >= 1, ``non_negative`` ones >= 0;
  ``powers_of_two`` fields are a power of two (their tiles are ``tl.arange`` extents);
  ``warps`` fields are a power of two in ``[1, MAX_WARPS]`` (a CTA holds at most 1024
  threads); ``choices`` fields are one of the values listed. An optional field's None is
  always accepted (the rule).

The check runs only isinstance tests and comparisons on a table made once per class (when the
module defining it is imported), so a config made inside a ``torch.compile`` region traces.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Mapping, Sequence

import torch

# Warps per program: a power of two, at most 32 (1024 threads per CTA).
MAX_WARPS = 32
# The annotated types the type check knows; fields of other types are left to their own checks.
_CHECKED_TYPES = (bool, int, str)


def _field_table(cls) -> tuple:
    """(name, type or None, optional) of every field of the dataclass ``cls``: the type when its
    annotation is one of :data:`_CHECKED_TYPES` or ``Optional`` of one, else None."""
    hints = typing.get_type_hints(cls)
    table = []
    for field in dataclasses.fields(cls):
        hint, optional = hints[field.name], False
        args = typing.get_args(hint)
        if typing.get_origin(hint) is typing.Union and type(None) in args:
            rest = [arg for arg in args if arg is not type(None)]
            hint, optional = (rest[0] if len(rest) == 1 else None), True
        table.append((field.name, hint if hint in _CHECKED_TYPES else None, optional))
    return tuple(table)


def _type_ok(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, (bool, torch.SymBool))
    if kind is int:
        return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _concrete(value) -> bool:
    return not isinstance(value, (torch.SymInt, torch.SymBool))


def check_launch(config, table: tuple, positive: Sequence[str] = (),
                 non_negative: Sequence[str] = (), powers_of_two: Sequence[str] = (),
                 warps: Sequence[str] = (), choices: Mapping[str, tuple] = None) -> None:
    """Raise TypeError / ValueError unless every field of ``config`` has its annotated type and
    its range (the module docstring); ``table`` is ``_field_table(type(config))``."""
    what = type(config).__name__
    for name, kind, optional in table:
        value = getattr(config, name)
        if kind is None or (optional and value is None):
            continue
        if not _type_ok(value, kind):
            article = "an" if kind is int else "a"
            raise TypeError(f"{what}.{name}={value!r} must be {'None or ' if optional else ''}"
                            f"{article} {kind.__name__}")
    for name in positive:
        value = getattr(config, name)
        if value is not None and _concrete(value) and value < 1:
            raise ValueError(f"{what}.{name}={value!r} must be a positive int")
    for name in non_negative:
        value = getattr(config, name)
        if value is not None and _concrete(value) and value < 0:
            raise ValueError(f"{what}.{name}={value!r} must be an int >= 0")
    for name in powers_of_two:
        value = getattr(config, name)
        if value is not None and _concrete(value) and (value < 1 or value & (value - 1)):
            raise ValueError(f"{what}.{name}={value!r} must be a positive power of two")
    for name in warps:
        value = getattr(config, name)
        if _concrete(value) and (value < 1 or value & (value - 1) or value > MAX_WARPS):
            raise ValueError(f"{what}.{name}={value!r} must be a power of two in "
                             f"[1, {MAX_WARPS}] (warps per program)")
    for name, allowed in (choices or {}).items():
        value = getattr(config, name)
        if value is not None and _concrete(value) and value not in allowed:
            optional = dict((n, o) for n, _, o in table)[name]
            raise ValueError(f"{what}.{name}={value!r} must be one of {tuple(allowed)}"
                             f"{' or None (the rule)' if optional else ''}")


def checked_launch(*, positive: Sequence[str] = (), non_negative: Sequence[str] = (),
                   powers_of_two: Sequence[str] = (), warps: Sequence[str] = (),
                   choices: Mapping[str, tuple] = None, extra=None):
    """Class decorator, in place of ``@dataclass(frozen=True)``: makes the class a frozen
    dataclass whose ``__post_init__`` runs :func:`check_launch` with these rules, then
    ``extra(config)`` (a check of the class's own) where given. Every name must be a field of
    the class. (The ``__post_init__`` is set before the dataclass is made: its ``__init__``
    calls one only if the class has it then.)"""
    def decorate(cls):
        table = ()   # set below, once the dataclass's fields exist
        rules = (tuple(positive), tuple(non_negative), tuple(powers_of_two), tuple(warps),
                 dict(choices or {}))

        def __post_init__(self):
            check_launch(self, table, *rules)
            if extra is not None:
                extra(self)
        cls.__post_init__ = __post_init__
        cls = dataclasses.dataclass(frozen=True)(cls)
        table = _field_table(cls)
        names = {name for name, _, _ in table}
        unknown = (set(positive) | set(non_negative) | set(powers_of_two) | set(warps)
                   | set(choices or {})) - names
        if unknown:
            raise TypeError(f"checked_launch({cls.__name__}): no fields {sorted(unknown)}")
        return cls
    return decorate
