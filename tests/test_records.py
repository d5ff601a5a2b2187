"""paicli.records: the record classes of the submit's and the master's paths behave
as the dataclasses they replaced (construction, equality, hashing, freezing,
repr, __post_init__, replace, asdict)."""

from __future__ import annotations

import dataclasses
import pickle
from collections import namedtuple

import pytest

from paicli import records
from paicli.records import FrozenInstanceError, field, record


@record
class Mutable:
    name: str
    count: int = 1
    tags: list = field(default_factory=list)
    note: str = field(default="", repr=False, compare=False)


@record(frozen=True)
class Frozen:
    host: str
    cpu: int
    attrs: dict = field(default_factory=dict, compare=False)


@dataclasses.dataclass
class MutableTwin:
    name: str
    count: int = 1
    tags: list = dataclasses.field(default_factory=list)
    note: str = dataclasses.field(default="", repr=False, compare=False)


Pair = namedtuple("Pair", "a b")


def test_construction_by_position_keyword_and_default():
    a = Mutable("x", 2, ["t"])
    b = Mutable(name="x", count=2, tags=["t"])
    assert a == b and a.count == 2 and a.tags == ["t"]
    c, d = Mutable("y"), Mutable("y")
    assert c.count == 1 and c.note == "" and c.tags == []
    c.tags.append(1)
    assert d.tags == []   # a factory: a fresh list for each record


@pytest.mark.parametrize("call, words", [
    (lambda: Mutable(), "missing required argument: 'name'"),
    (lambda: Mutable("a", 1, [], "n", 5), "takes 4 positional arguments but 5 were given"),
    (lambda: Mutable("a", colour=1), "unexpected keyword argument 'colour'"),
    (lambda: Mutable("a", name="b"), "multiple values for argument 'name'"),
])
def test_a_wrong_call_is_a_type_error_that_names_the_argument(call, words):
    with pytest.raises(TypeError, match=words):
        call()


def test_same_repr_and_equality_as_the_dataclass_it_replaced():
    ours, theirs = Mutable("x", 3, [1], note="hidden"), MutableTwin("x", 3, [1], note="hidden")
    assert repr(ours).replace("Mutable", "") == repr(theirs).replace("MutableTwin", "")
    assert "hidden" not in repr(ours)
    assert Mutable("x", note="a") == Mutable("x", note="b")   # compare=False
    assert Mutable("x") != Mutable("y") and Mutable("x") != MutableTwin("x")
    assert Mutable.__hash__ is None and MutableTwin.__hash__ is None   # mutable and compared: unhashable
    nan = float("nan")
    assert Mutable(nan) == Mutable(nan) and MutableTwin(nan) == MutableTwin(nan)   # fields compared as a tuple


def test_a_frozen_record_refuses_assignment_and_hashes_by_its_compared_fields():
    node = Frozen("h", 100, {"zone": "a"})
    with pytest.raises(FrozenInstanceError):
        node.cpu = 200
    with pytest.raises(AttributeError):
        del node.host
    assert node.cpu == 100
    twin = Frozen("h", 100)
    assert node == twin and hash(node) == hash(twin) and {node: 1}[twin] == 1
    assert Frozen("h", 101) != node


def test_post_init_runs_on_construction_and_replace():
    seen = []

    @record(frozen=True)
    class Checked:
        value: int
        double: int = 0

        def __post_init__(self):
            seen.append(self.value)
            object.__setattr__(self, "double", self.value * 2)

    one = Checked(2)
    two = records.replace(one, value=5)
    assert (one.double, two.double, seen) == (4, 10, [2, 5])
    assert one.value == 2   # replace made a new record


def test_asdict_turns_nested_records_into_dicts_and_keeps_container_types():
    @record
    class Outer:
        inner: list
        by_name: dict
        pair: tuple

    out = Outer([Frozen("a", 1)], {"k": Frozen("b", 2, {"z": 1})}, (Pair(Frozen("c", 3), 4), 5))
    assert records.asdict(out) == {
        "inner": [{"host": "a", "cpu": 1, "attrs": {}}],
        "by_name": {"k": {"host": "b", "cpu": 2, "attrs": {"z": 1}}},
        "pair": (Pair({"host": "c", "cpu": 3, "attrs": {}}, 4), 5)}
    assert type(records.asdict(out)["pair"][0]) is Pair


def test_fields_in_order_with_inherited_ones_first():
    @record
    class Child(Mutable):
        extra: int = 0

    assert [f.name for f in records.fields(Child)] == ["name", "count", "tags", "note", "extra"]
    assert Child("x", extra=3).extra == 3 and records.is_record(Child("x")) and not records.is_record(1)


def test_a_class_dataclasses_would_refuse_is_refused():
    with pytest.raises(ValueError, match="mutable default"):
        @record
        class Shared:
            items: list = []   # noqa: RUF012 - the point of the test
    with pytest.raises(TypeError, match="without a default follows"):
        @record
        class Order:
            a: int = 0
            b: int


def test_records_pickle_as_the_ray_backend_ships_them():
    node = Frozen("h", 100, {"zone": "a"})
    back = pickle.loads(pickle.dumps(node))
    assert back == node and back.attrs == {"zone": "a"}
    with pytest.raises(FrozenInstanceError):
        back.cpu = 1


def test_the_job_plan_round_trips_through_its_json():
    from paicli.jobplan import JobPlan, RolePlan

    plan = JobPlan("j", "python", "t", [RolePlan("ps", 1, ["a"], must_finish=False), RolePlan("worker", 2, ["b"])],
                   notes=["n"], inputs=["/x"])
    assert JobPlan.from_json(plan.to_json()) == plan


def test_a_method_the_class_defines_is_kept():
    @record
    class Named:
        name: str

        def __repr__(self) -> str:
            return f"<{self.name}>"

    assert repr(Named("x")) == "<x>" and Named("x") == Named("x")
