"""Record classes for the modules every submit and every job master import.

`@record` reads a class's annotated fields, as `@dataclass` does, and gives it
`__init__`, `__repr__`, `__eq__` (and, frozen, `__hash__` and no assignment),
with `field(default_factory=..., repr=..., compare=...)`, `__post_init__`,
`replace`, `asdict` and `fields`. It builds no source text: dataclasses
compiles each method with exec(), ~0.6 ms a class here, and imports inspect
(~7 ms), and `pai` builds ~20 such classes in each of its two processes before
an instance starts (docs/decisions.md, seventh pass). Classes off that path
(Pluto's, the tuner's) keep dataclasses.
"""

from __future__ import annotations

MISSING = object()


class FrozenInstanceError(AttributeError):
    """An assignment to a field of a frozen record."""


class Field:
    __slots__ = ("name", "default", "default_factory", "repr", "compare")

    def __init__(self, default=MISSING, default_factory=MISSING, repr: bool = True, compare: bool = True):
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("a field cannot have both a default and a default_factory")
        self.name = ""
        self.default, self.default_factory, self.repr, self.compare = default, default_factory, repr, compare

    def __repr__(self) -> str:
        return f"Field({self.name!r})"


def field(*, default=MISSING, default_factory=MISSING, repr: bool = True, compare: bool = True) -> Field:
    return Field(default, default_factory, repr, compare)


def record(cls=None, /, *, frozen: bool = False):
    """`@record` or `@record(frozen=True)` on a class with annotated fields."""
    def wrap(klass):
        return _build(klass, frozen)
    return wrap if cls is None else wrap(cls)


def fields(obj) -> tuple[Field, ...]:
    """The fields of a record class or instance, in order."""
    return obj.__record_fields__


def is_record(obj) -> bool:
    return hasattr(obj, "__record_fields__")


def replace(obj, **changes):
    """A copy of `obj` with `changes` (built through __init__, as dataclasses.replace)."""
    values = {f.name: getattr(obj, f.name) for f in obj.__record_fields__}
    values.update(changes)
    return type(obj)(**values)


def asdict(obj) -> dict:
    """`obj` as a dict, records inside it (in lists, tuples and dicts too) as dicts."""
    return {f.name: _plain(getattr(obj, f.name)) for f in obj.__record_fields__}


def _plain(value):
    if hasattr(type(value), "__record_fields__"):
        return asdict(value)
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return type(value)(items) if type(value) in (list, tuple) else type(value)(*items)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


# -- building a class -------------------------------------------------------------------------


def _build(cls, frozen: bool):
    inherited = [f for base in reversed(cls.__mro__[1:]) for f in getattr(base, "__record_fields__", ())]
    by_name = {f.name: f for f in (*inherited, *_own_fields(cls))}   # a redefined field keeps its place
    all_fields = tuple(by_name.values())
    _check_order(cls, all_fields)
    compared = tuple(f.name for f in all_fields if f.compare)
    cls.__record_fields__ = all_fields
    # What the class defines itself is kept, as dataclasses keeps it.
    for name, method in (("__init__", _init(cls, all_fields)), ("__repr__", _repr(all_fields)),
                         ("__eq__", _eq(compared))):
        if name not in cls.__dict__:
            setattr(cls, name, method)
    if frozen:
        cls.__hash__ = _hash(compared)
        cls.__setattr__ = _refuse
        cls.__delattr__ = _refuse
    elif cls.__dict__.get("__hash__") is None:
        cls.__hash__ = None   # mutable and compared by value: not hashable (as dataclasses does)
    return cls


def _own_fields(cls) -> list[Field]:
    """The fields the class body annotates, in order; their defaults stay class
    attributes (a factory's does not)."""
    own = []
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        if "ClassVar" in str(annotation):
            continue
        value = cls.__dict__.get(name, MISSING)
        spec = value if isinstance(value, Field) else Field(default=value)
        if isinstance(spec.default, (list, dict, set)):
            raise ValueError(f"{cls.__name__}.{name}: a mutable default; use field(default_factory=...)")
        spec.name = name
        if isinstance(value, Field):
            if spec.default is MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, spec.default)
        own.append(spec)
    return own


def _check_order(cls, all_fields: tuple[Field, ...]) -> None:
    seen_default = False
    for f in all_fields:
        if f.default is not MISSING or f.default_factory is not MISSING:
            seen_default = True
        elif seen_default:
            raise TypeError(f"{cls.__name__}: field {f.name!r} without a default follows one with a default")


def _init(cls, all_fields: tuple[Field, ...]):
    names = tuple(f.name for f in all_fields)
    known = frozenset(names)
    defaults = {f.name: f.default for f in all_fields if f.default is not MISSING}
    factories = {f.name: f.default_factory for f in all_fields if f.default_factory is not MISSING}
    post_init = getattr(cls, "__post_init__", None)
    title = cls.__qualname__
    set_field = object.__setattr__

    def __init__(self, *args, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"{title}() takes {len(names)} positional arguments but {len(args)} were given")
        for key in kwargs:
            if key not in known:
                raise TypeError(f"{title}() got an unexpected keyword argument {key!r}")
        for i, name in enumerate(names):
            if i < len(args):
                if name in kwargs:
                    raise TypeError(f"{title}() got multiple values for argument {name!r}")
                value = args[i]
            elif name in kwargs:
                value = kwargs[name]
            elif name in defaults:
                value = defaults[name]
            elif name in factories:
                value = factories[name]()
            else:
                raise TypeError(f"{title}() missing required argument: {name!r}")
            set_field(self, name, value)
        if post_init is not None:
            self.__post_init__()

    __init__.__qualname__ = f"{title}.__init__"
    return __init__


def _repr(all_fields: tuple[Field, ...]):
    shown = tuple(f.name for f in all_fields if f.repr)

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in shown)
        return f"{type(self).__qualname__}({inner})"

    return __repr__


def _eq(compared: tuple[str, ...]):
    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return tuple(getattr(self, name) for name in compared) == tuple(getattr(other, name) for name in compared)

    return __eq__


def _hash(compared: tuple[str, ...]):
    def __hash__(self) -> int:
        return hash(tuple(getattr(self, name) for name in compared))

    return __hash__


def _refuse(self, name, *value):
    raise FrozenInstanceError(f"cannot assign to field {name!r}")
