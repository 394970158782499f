"""App args as both apps take them (a Serve config's `args`, `kvfabric up --args`): a
frozen pydantic model each, strict (no "3" for 3, no true for 1), unknown names refused,
and every refusal an AppArgsError that names the field."""

from __future__ import annotations

import os
from typing import Annotated, Any, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError


class AppArgsError(ValueError):
    """App args that do not make a valid app (unknown names, bad values)."""


class Args(BaseModel):
    # protected_namespaces: fields may start with model_ (model_dir, model_id, model_name).
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, protected_namespaces=())

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise AppArgsError(describe(e)) from None

    @classmethod
    def from_dict(cls, args: Any) -> Self:
        """From a mapping (None: the defaults)."""
        if args is None:
            return cls()
        if not isinstance(args, dict):
            raise AppArgsError(f"app args must be a mapping, got {type(args).__name__}")
        if not all(isinstance(k, str) for k in args):
            raise AppArgsError(f"app args' names must be strings, got {sorted(map(repr, args))}")
        return cls(**args)

    def as_dict(self) -> dict[str, Any]:
        """The args as a mapping `from_dict` takes back."""
        return self.model_dump()

    def but(self, **changes: Any) -> Self:
        """A copy with `changes`, checked as a new one is."""
        return type(self)(**{**self.model_dump(), **changes})


def describe(e: ValidationError) -> str:
    """One line per refused field: its name, what is wrong, what was given."""
    unknown = [str(err["loc"][0]) for err in e.errors() if err["type"] == "extra_forbidden"]
    lines = [f"unknown app args: {sorted(unknown)}"] if unknown else []
    for err in e.errors():
        if err["type"] == "extra_forbidden":
            continue
        where = ".".join(map(str, err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}, got {err['input']!r}" if where else msg)
    return "; ".join(lines)


def _absolute(path: str) -> str:
    if not os.path.isabs(path):
        raise ValueError("must be an absolute path")
    return path


def _absolute_or_empty(path: str) -> str:
    if path and not os.path.isabs(path):
        raise ValueError("must be an absolute path or empty")
    return path


AbsolutePath = Annotated[str, AfterValidator(_absolute)]
AbsolutePathOrEmpty = Annotated[str, AfterValidator(_absolute_or_empty)]
