"""Check shardfs's CSI messages (shardfs/csi/proto.py) against the spec's csi.proto.

    python -m shardfs.devtools.csicheck PATH/TO/csi.proto

The spec file is read, never copied (take it from container-storage-interface/spec). Every
message, field, enum value, service and method we define must be in the spec with the same
name, number, type and label; what the spec has beyond ours is listed as not used. Exit
status 0 when everything we define matches.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shardfs.csi.proto import MESSAGES, SERVICES, Message

_FIELD = re.compile(r"^(repeated\s+)?(map\s*<\s*string\s*,\s*string\s*>|[.\w]+)\s+(\w+)\s*=\s*"
                    r"(\d+)")
_VALUE = re.compile(r"^(\w+)\s*=\s*(\d+)")
_RPC = re.compile(r"rpc\s+(\w+)\s*\(\s*([.\w]+)\s*\)\s*returns\s*\(\s*([.\w]+)\s*\)")


@dataclass
class SpecMessage:
    fields: dict[str, tuple[int, str, bool]] = field(default_factory=dict)  # type, repeated
    enums: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class Spec:
    messages: dict[str, SpecMessage] = field(default_factory=dict)  # "Outer.Inner" -> ...
    rpcs: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse(text: str) -> Spec:
    """A small reader of the proto3 subset csi.proto uses: messages (nested), oneofs, enums,
    maps, services. Statements end at ';', blocks at '}'."""
    spec = Spec()
    tokens = re.findall(r"[{};]|[^{};]+", _strip_comments(text))
    stack: list[tuple[str, str]] = []  # open blocks: (kind, name)
    last = ""
    for token in (t.strip() for t in tokens):
        if token == "{":
            head = last.split()
            kind = head[0] if head and head[0] in ("message", "enum", "service", "oneof") \
                else "other"
            name = head[1] if kind != "other" and len(head) > 1 else ""
            if kind == "other" and head and head[0] == "rpc":
                _statement(spec, stack, last)  # `rpc X(...) returns (...) {}`
            stack.append((kind, name))
            if kind == "message":
                spec.messages[_scope(stack)] = SpecMessage()
            elif kind == "service":
                spec.rpcs[name] = {}
            last = ""
        elif token == "}":
            stack.pop()
            last = ""
        elif token == ";":
            _statement(spec, stack, last)
            last = ""
        else:
            last = token
    return spec


def _statement(spec: Spec, stack: list[tuple[str, str]], text: str) -> None:
    if not stack or not text:
        return
    kind, name = stack[-1]
    if kind == "service":
        match = _RPC.search(text)
        if match:
            spec.rpcs[name][match.group(1)] = (match.group(2), match.group(3))
    elif kind == "enum":
        match = _VALUE.match(text)
        owner = spec.messages.get(_scope(stack[:-1]))
        if match and owner is not None:
            owner.enums.setdefault(name, {})[match.group(1)] = int(match.group(2))
    elif kind in ("message", "oneof"):
        match = _FIELD.match(text)
        if match:
            scope = _scope(stack)
            ftype = "map" if match.group(2).startswith("map") else match.group(2)
            spec.messages[scope].fields[match.group(3)] = (
                int(match.group(4)), ftype, bool(match.group(1)))


def _scope(stack: list[tuple[str, str]]) -> str:
    return ".".join(name for kind, name in stack if kind == "message")


def _short(type_name: str) -> str:
    """`.csi.v1.VolumeCapability.AccessMode.Mode` -> `Mode` (the spec writes relative names)."""
    return type_name.rsplit(".", 1)[-1]


def compare(spec: Spec) -> tuple[list[str], list[str]]:
    """(mismatches, spec fields we do not define)."""
    bad: list[str] = []
    unused: list[str] = []

    def check(msg: Message, scope: str) -> None:
        theirs = spec.messages.get(scope)
        if theirs is None:
            bad.append(f"message {scope}: not in the spec")
            return
        for f in msg.fields:
            if f.name not in theirs.fields:
                bad.append(f"{scope}.{f.name}: not in the spec")
                continue
            number, ftype, repeated = theirs.fields[f.name]
            ours_type = "map" if f.type == "map" else f.type
            if number != f.number:
                bad.append(f"{scope}.{f.name}: number {f.number}, the spec says {number}")
            if _short(ours_type) != _short(ftype):
                bad.append(f"{scope}.{f.name}: type {ours_type}, the spec says {ftype}")
            if repeated != f.repeated:
                bad.append(f"{scope}.{f.name}: repeated={f.repeated}, the spec says "
                           f"{repeated}")
        for name in theirs.fields.keys() - {f.name for f in msg.fields}:
            unused.append(f"{scope}.{name}")
        for enum_name, values in msg.enums:
            spec_values = theirs.enums.get(enum_name)
            if spec_values is None:
                bad.append(f"enum {scope}.{enum_name}: not in the spec")
                continue
            for value, number in values:
                if spec_values.get(value) != number:
                    bad.append(f"{scope}.{enum_name}.{value} = {number}, the spec says "
                               f"{spec_values.get(value)}")
        for sub in msg.nested:
            check(sub, f"{scope}.{sub.name}")

    for msg in MESSAGES:
        check(msg, msg.name)
    for service, methods in SERVICES.items():
        for method, request, response in methods:
            theirs = spec.rpcs.get(service, {}).get(method)
            if theirs != (request, response):
                bad.append(f"rpc {service}.{method}({request}) -> {response}: the spec says "
                           f"{theirs}")
    return bad, sorted(unused)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    spec = parse(Path(args[0]).read_text())
    bad, unused = compare(spec)
    checked = sum(1 for _ in _walk(MESSAGES))
    for line in bad:
        print(f"MISMATCH {line}")
    print(f"{checked} messages, {sum(len(m) for m in SERVICES.values())} rpcs checked; "
          f"{len(bad)} mismatch(es); spec fields of those messages we leave out: "
          f"{', '.join(unused) or 'none'}")
    return 1 if bad else 0


def _walk(msgs: tuple[Message, ...]):
    for m in msgs:
        yield m
        yield from _walk(m.nested)


if __name__ == "__main__":
    sys.exit(main())
