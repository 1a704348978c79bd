"""Options of config classes (strategies, policies): their dataclass fields, checked against type hints."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from kvfactory.errors import ConfigError


def options_of(cls: type) -> dict[str, Any]:
    """Config options of a strategy class: its init fields and their type hints, except private ones and
    those marked ``metadata={"option": False}`` (set by ``kvfactory.compose``, not by a config)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if f.init and not f.name.startswith("_") and f.metadata.get("option", True)}


def type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is Any:
        return True
    return isinstance(value, origin or hint)


def describe(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


Spec = TypeVar("Spec")


def parse_spec(spec: type[Spec], strategy: str, options: dict[str, Any], own: dict[str, Any],
               hyper: dict[str, Any], where: str, kind: str, strategy_key: str) -> Spec:
    """``spec(strategy, **own options, options=the strategy's hyperparameters)`` from a config entry's
    ``options``. Each must be one of ``own`` (the spec's fields and their type hints; None: the spec
    checks it) or of ``hyper`` (the strategy's), and of its type; else a ``ConfigError`` naming the
    entry's key (prefixed with ``where``), as does a spec or strategy that refuses a value."""
    for key, value in options.items():
        if key not in own and key not in hyper:
            raise ConfigError(f"{where}{key}", value, f"options of {kind} '{strategy}': "
                                                      f"{sorted(set(own) | set(hyper))}")
        hint = own[key] if key in own else hyper[key]
        if hint is not None and not type_ok(value, hint):
            raise ConfigError(f"{where}{key}", value, describe(hint))
    try:
        return spec(strategy, **{k: v for k, v in options.items() if k in own},
                    options={k: v for k, v in options.items() if k in hyper})
    except (ConfigError, TypeError) as exc:
        if isinstance(exc, TypeError):
            raise ConfigError(f"{where}{strategy_key}", strategy, str(exc)) from None
        raise ConfigError(f"{where}{exc.key}", exc.value, exc.allowed) from None


def check_registration(kind: str, name: Any, cls: Any, base: type) -> None:
    """A user's ``kind`` (policy, selector) must be a ``@dataclass`` subclass of ``base`` with a name."""
    if not (isinstance(cls, type) and issubclass(cls, base) and "__dataclass_fields__" in cls.__dict__):
        raise ConfigError(f"{kind} class", cls, f"a subclass of {base.__name__} ({base.__module__}) "
                          f"decorated with @dataclass")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{kind} name", name, "a non-empty string")
