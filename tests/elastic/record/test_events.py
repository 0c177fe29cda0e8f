"""Every ledger event is declared in elastic/record/events.py: the ledger refuses anything else, and no
module names an event type with a bare string."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from elastic.record.events import EVENTS, Event, NodeLaunched, NodeReleased, RunEnded, UnknownEvent, fields, parse, read
from elastic.record.ledger import Ledger, read_events

REPO = Path(__file__).resolve().parents[3]
SOURCES = [p for d in ("elastic", "providers", "bench") for p in sorted((REPO / d).rglob("*.py"))
           if p != REPO / "elastic" / "events.py"]


def test_the_ledger_writes_declared_events_with_every_field(tmp_path):
    ledger = Ledger(tmp_path / "events.jsonl")
    record = ledger.append(NodeReleased(instance_id="i-1"))
    ledger.close()
    assert set(record) == {"t", "type", "instance_id", "released_at"} and record["released_at"] is None
    assert read_events(tmp_path / "events.jsonl") == [record]
    assert parse(record) == NodeReleased(instance_id="i-1")


def test_the_ledger_refuses_what_events_py_does_not_declare(tmp_path):
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Stray(Event):
        TYPE = "stray"
        note: str

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Disguised(RunEnded):   # a subclass of a declared event is not that event
        extra: int = 0

    ledger = Ledger(tmp_path / "events.jsonl")
    for bad in ("run_ended", {"type": "run_ended", "status": "completed"}, Stray(note="x"),
                Disguised(status="completed")):
        with pytest.raises(TypeError, match="not an event declared"):
            ledger.append(bad)
    ledger.close()
    assert read_events(tmp_path / "events.jsonl") == []


def test_a_missing_or_unknown_field_is_an_error():
    with pytest.raises(TypeError):
        RunEnded()                                   # status is required
    with pytest.raises(TypeError):
        RunEnded(status="completed", seconds=1.0)    # not a field of run_ended
    with pytest.raises(TypeError):
        RunEnded("completed")                        # keyword-only: a field is always named
    with pytest.raises(TypeError, match="undeclared event type"):
        parse({"t": 0.0, "type": "run_paused"})
    with pytest.raises(TypeError):
        parse({"t": 0.0, "type": "outer_step", "outer_step": 1})


def test_every_declared_event_round_trips_through_json_typed():
    for type_, cls in EVENTS.items():
        assert cls.TYPE == type_ and cls.__doc__, cls
        values = {f.name: (f.default if f.default is not dataclasses.MISSING else 1) for f in fields(cls)}
        record = json.loads(json.dumps(cls(**values).record(1.5)))
        assert record["type"] == type_ and "t" in record and list(record)[2:] == list(values)
        assert parse(record) == cls(**values)
        [typed] = read([record])
        assert type(typed) is cls and typed == cls(**values) and typed.t == 1.5
        assert typed.record(1.5) == record                  # back to the same bytes on disk
        assert typed.story() is None or isinstance(typed.story(), str)


def test_reading_back_is_lenient_about_other_versions():
    [newer, older, extra] = read([
        {"t": 1.0, "type": "run_paused_by_a_newer_version", "why": "x"},
        {"t": 2.0, "type": "world_restored", "from_step": 3, "uri": None},        # before `after` was added
        {"t": 3.0, "type": "node_released", "instance_id": "i", "released_at": None, "zone": "z"}])
    assert isinstance(newer, UnknownEvent) and newer.type == "run_paused_by_a_newer_version"
    assert newer.fields == {"why": "x"} and newer.story() is None
    assert older.after == "loss" and older.t == 2.0
    assert extra == NodeReleased(instance_id="i")       # a field this version does not know is dropped


def test_node_launched_takes_its_vm_fields_from_the_offer():
    from providers.base import Offer

    kept = [f for f in dataclasses.fields(Offer) if f.name not in Offer.NOT_KEPT]
    own = [f for f in fields(NodeLaunched) if f.name not in ("instance_id", "ray_node_id", "role", "launched_at",
                                                                "joined")]
    assert [(f.name, f.type) for f in own] == [(f.name, f.type) for f in kept]
    offer = Offer("aws", "us-east-1", "us-east-1a", "g5.xlarge", "A10G", 1, 4, True, 0.5, 1.0, read_at=9.0)
    e = NodeLaunched.of(offer, instance_id="i", ray_node_id=None, role="replica", launched_at=10.0, joined=True)
    assert e.instance_type == "g5.xlarge" and e.on_demand_usd_per_hour == 1.0
    assert e.story() == "rented i: g5.xlarge in aws:us-east-1a (spot, $0.5000/h)"


def _names_an_event_type(node: ast.AST) -> str | None:
    """A string constant naming a declared event type where a type is meant: compared with
    `x["type"]` or `kind`, the value of a dict's "type" key, or the first argument of
    `ledger.append`."""
    def const_types(n):
        items = n.elts if isinstance(n, (ast.Tuple, ast.List, ast.Set)) else [n]
        return [i.value for i in items if isinstance(i, ast.Constant) and i.value in EVENTS]

    def is_type_of(n):
        return (isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "type") \
            or (isinstance(n, ast.Name) and n.id == "kind")

    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        if any(is_type_of(s) for s in sides):
            for s in sides:
                if found := const_types(s):
                    return found[0]
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values):
            if isinstance(k, ast.Constant) and k.value == "type" and (found := const_types(v)):
                return found[0]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
            and "ledger" in ast.unparse(node.func.value).lower() and node.args
            and isinstance(node.args[0], ast.Constant)):
        return repr(node.args[0].value)
    if isinstance(node, ast.Set) and len(const_types(node)) == len(node.elts) > 1:
        return const_types(node)[0]   # a set of event types (`bad = {"node_preempted", ...}`)
    return None


def test_no_module_names_an_event_type_with_a_bare_string():
    offenders = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (found := _names_an_event_type(node)) is not None:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {found}")
    assert offenders == [], "use the classes of elastic/record/events.py:\n" + "\n".join(offenders)


def test_the_check_above_sees_the_shapes_it_forbids():
    # The AST check must not pass vacuously: each shape it looks for, written out, is caught.
    for snippet in ('e["type"] == "outer_step"', 'kind in ("node_notice", "node_preempted")',
                    '{"t": 0, "type": "node_released"}', 'self.ledger.append("run_ended", status="x")',
                    'bad = {"replica_lost", "node_preempted"}'):
        assert any(_names_an_event_type(n) for n in ast.walk(ast.parse(snippet))), snippet
    assert not any(_names_an_event_type(n) for n in ast.walk(ast.parse(
        'e["type"] == OuterStep.TYPE and e["outer_step"] == 1 and status == "budget_exhausted"')))


def test_the_guide_lists_every_event_and_its_fields():
    guide = (REPO / "docs" / "guide.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", guide, re.M)}
    missing = []
    for type_, cls in EVENTS.items():
        if type_ not in rows:
            missing.append(type_)
        else:
            missing += [f"{type_}.{f.name}" for f in fields(cls) if f"`{f.name}`" not in rows[type_]]
    assert missing == [], f"docs/guide.md's ledger table lacks: {missing}"
