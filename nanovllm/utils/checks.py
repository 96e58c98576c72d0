"""Checking user input against a dataclass's own fields (Config, SamplingParams): each value's type
against its annotation, its value against its `Literal` choices or its row in a table of rules. An
error names the field, the value and what is allowed."""
import typing
from dataclasses import fields

# what isinstance asks of a field: a float field takes an int, a list field a tuple
KINDS = {float: (int, float), list[str]: (list, tuple), list[int]: (list, tuple)}


def check_fields(obj, rules: dict):
    """A TypeError or ValueError for the first field of `obj` whose value its annotation or its row
    in `rules` (name: (test, what is allowed)) refuses; a bool is an int only to a bool field."""
    for f in fields(obj):
        value, args = getattr(obj, f.name), typing.get_args(f.type)
        kind = KINDS.get(f.type, f.type)
        test, allowed = rules.get(f.name, (None, f"of type {f.type if args else f.type.__name__}"))
        if typing.get_origin(f.type) is typing.Literal:  # of its choices' types, and one of them
            kind, test, allowed = tuple(map(type, args)), args.__contains__, f"one of {args}"
        if not isinstance(value, kind) or isinstance(value, bool) and bool not in (kind, *args):
            raise TypeError(f"{f.name}={value!r} must be {allowed}")
        if test and not test(value):
            raise ValueError(f"{f.name}={value!r} must be {allowed}")
