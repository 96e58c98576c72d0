"""Checking user input against a dataclass's own fields (Config, SamplingParams): each value's type
against its annotation, its value against its `Literal` choices or the rule declared with it
(`rule`). An error names the field, the value and what is allowed."""
import typing
from dataclasses import field, fields

# what isinstance asks of a field: a float field takes an int, a list field a tuple
KINDS = {float: (int, float), list[str]: (list, tuple), list[int]: (list, tuple)}


def rule(default, test, allowed: str):
    """A field with a default (a list default: a fresh copy per object) that `check_fields` holds
    to `test(value)`; `allowed` says what passes."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"rule": (test, allowed)})
    return field(default=default, metadata={"rule": (test, allowed)})


def at_least(bound: int, default: int):
    """An integer field whose value is at least `bound`."""
    return rule(default, lambda v: v >= bound, f"an integer >= {bound}")


def check_fields(obj):
    """A TypeError or ValueError for the first field of `obj` whose value its annotation or its
    rule refuses; a bool is an int only to a bool field."""
    for f in fields(obj):
        value, args = getattr(obj, f.name), typing.get_args(f.type)
        kind = KINDS.get(f.type, f.type)
        of_type = f"of type {f.type if args else f.type.__name__}"
        test, allowed = f.metadata.get("rule", (None, of_type))
        if typing.get_origin(f.type) is typing.Literal:  # of its choices' types, and one of them
            kind, test, allowed = tuple(map(type, args)), args.__contains__, f"one of {args}"
        if not isinstance(value, kind) or isinstance(value, bool) and bool not in (kind, *args):
            raise TypeError(f"{f.name}={value!r} must be {allowed}")
        if test and not test(value):
            raise ValueError(f"{f.name}={value!r} must be {allowed}")
