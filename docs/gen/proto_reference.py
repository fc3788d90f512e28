"""The gRPC reference of docs/api.md, generated from protos/ when the site is built (mkdocs-gen-files).

protoc (grpcio-tools) compiles the protos with their source info into a descriptor set; the
services, RPCs, messages, fields and enums are rendered with the comments written above them, and
the result replaces the marker line in docs/api.md. The comments in the .proto files are the one
place the API is described: change them, not this page.

    python docs/gen/proto_reference.py      # prints the generated Markdown
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

from markdown_text import inline, one_line, paragraphs  # noqa: E402

PAGE = "api.md"
MARKER = "<!-- generated: gRPC reference -->"
PROTO_ROOT = ROOT / "protos"
PUBLIC = "splitserve/v1/generation.proto"
INTERNAL = "splitserve/v1/worker.proto"

# FileDescriptorProto / DescriptorProto / ServiceDescriptorProto field numbers, for source-info paths.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE, FILE_SYNTAX = 4, 5, 6, 12
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
SERVICE_METHOD, ENUM_VALUE = 2, 2


def descriptor_set():
    """The protos compiled with their comments (a FileDescriptorSet)."""
    import grpc_tools
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    bundled = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "protos.pb"
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{bundled}", "--include_source_info",
                f"--descriptor_set_out={out}", PUBLIC, INTERNAL]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed: {' '.join(args)}")
        fds = descriptor_pb2.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
    return fds


def anchor(full_name: str) -> str:
    return full_name.lstrip(".").lower().replace(".", "-")


class File:
    """One .proto file: its comments by source path, and its type names."""

    def __init__(self, proto, known: set[str]):
        self.proto = proto
        self.known = known
        self.comments = {}
        for loc in proto.source_code_info.location:
            text = loc.leading_comments or "\n\n".join(loc.leading_detached_comments)
            if text:
                self.comments[tuple(loc.path)] = "\n".join(line[1:] if line.startswith(" ") else line
                                                           for line in text.rstrip("\n").split("\n"))

    def comment(self, path: tuple) -> str:
        return self.comments.get(path, "")

    def type_ref(self, type_name: str) -> str:
        name = type_name.rsplit(".", 1)[-1]
        if type_name.lstrip(".") in self.known:
            return f"[`{name}`](#{anchor(type_name)})"
        return f"`{type_name.lstrip('.')}`"


def scalar(field) -> str:
    from google.protobuf import descriptor_pb2
    return descriptor_pb2.FieldDescriptorProto.Type.Name(field.type)[len("TYPE_"):].lower()


def render_service(f: File, index: int, service, package: str) -> list[str]:
    out = [f"### Service `{service.name}` {{ #{anchor(package + '.' + service.name)} }}", ""]
    if text := f.comment((FILE_SERVICE, index)):
        out += [paragraphs(text), ""]
    out += ["| RPC | request | response | what it does |", "|---|---|---|---|"]
    for i, method in enumerate(service.method):
        stream_in = "stream " if method.client_streaming else ""
        stream_out = "stream " if method.server_streaming else ""
        out.append(f"| `{method.name}` | {stream_in}{f.type_ref(method.input_type)} | "
                   f"{stream_out}{f.type_ref(method.output_type)} | "
                   f"{one_line(f.comment((FILE_SERVICE, index, SERVICE_METHOD, i)))} |")
    return out + [""]


def field_type(f: File, field, nested_maps: dict) -> str:
    from google.protobuf import descriptor_pb2
    FD = descriptor_pb2.FieldDescriptorProto
    if field.type_name.lstrip(".") in nested_maps:
        key, value = nested_maps[field.type_name.lstrip(".")]
        return f"map&lt;{field_type(f, key, {})}, {field_type(f, value, {})}&gt;"
    base = f.type_ref(field.type_name) if field.type in (FD.TYPE_MESSAGE, FD.TYPE_ENUM) else f"`{scalar(field)}`"
    if field.label == FD.LABEL_REPEATED:
        return f"repeated {base}"
    if field.proto3_optional:
        return f"optional {base}"
    return base


def render_message(f: File, path: tuple, message, prefix: str) -> list[str]:
    full = f"{prefix}.{message.name}"
    nested_maps = {f"{full}.{n.name}": (n.field[0], n.field[1]) for n in message.nested_type if n.options.map_entry}
    out = [f"#### `{full.split('.', 2)[-1]}` {{ #{anchor(full)} }}", ""]
    if text := f.comment(path):
        out += [paragraphs(text), ""]
    real_oneofs = {field.oneof_index for field in message.field
                   if field.HasField("oneof_index") and not field.proto3_optional}
    if message.field:
        out += ["| field | type | description |", "|---|---|---|"]
        for i, field in enumerate(message.field):
            note = ""
            if field.HasField("oneof_index") and field.oneof_index in real_oneofs:
                note = f"one of `{message.oneof_decl[field.oneof_index].name}`: "
            text = f.comment(path + (MESSAGE_FIELD, i))
            out.append(f"| `{field.name}` = {field.number} | {field_type(f, field, nested_maps)} | "
                       f"{note}{one_line(text)} |")
        out.append("")
    else:
        out += ["No fields.", ""]
    for i, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            out += render_message(f, path + (MESSAGE_NESTED, i), nested, full)
    for i, enum in enumerate(message.enum_type):
        out += render_enum(f, path + (MESSAGE_ENUM, i), enum, full)
    return out


def render_enum(f: File, path: tuple, enum, prefix: str) -> list[str]:
    full = f"{prefix}.{enum.name}"
    out = [f"#### enum `{full.split('.', 2)[-1]}` {{ #{anchor(full)} }}", ""]
    if text := f.comment(path):
        out += [paragraphs(text), ""]
    out += ["| value | number | description |", "|---|---|---|"]
    for i, value in enumerate(enum.value):
        out.append(f"| `{value.name}` | {value.number} | {one_line(f.comment(path + (ENUM_VALUE, i)))} |")
    return out + [""]


def render_file(f: File, title: str) -> list[str]:
    proto = f.proto
    package = proto.package
    out = [f"## {title}", "", f"`protos/{proto.name}`, package `{package}`.", ""]
    if text := f.comment((FILE_SYNTAX,)):
        out += [paragraphs(text), ""]
    for i, service in enumerate(proto.service):
        out += render_service(f, i, service, package)
    out += ["### Messages", ""]
    for i, message in enumerate(proto.message_type):
        out += render_message(f, (FILE_MESSAGE, i), message, package)
    for i, enum in enumerate(proto.enum_type):
        out += render_enum(f, (FILE_ENUM, i), enum, package)
    return out


def known_types(fds) -> set[str]:
    names = set()

    def walk(prefix, messages, enums):
        for e in enums:
            names.add(f"{prefix}.{e.name}")
        for m in messages:
            names.add(f"{prefix}.{m.name}")
            walk(f"{prefix}.{m.name}", m.nested_type, m.enum_type)

    for proto in fds.file:
        if proto.name in (PUBLIC, INTERNAL):
            walk(proto.package, proto.message_type, proto.enum_type)
    return names


def render() -> str:
    fds = descriptor_set()
    known = known_types(fds)
    files = {proto.name: File(proto, known) for proto in fds.file}
    lines = ["<!-- Generated from protos/ by docs/gen/proto_reference.py when the site is built. -->", ""]
    lines += render_file(files[PUBLIC], "gRPC reference: the public API")
    lines += render_file(files[INTERNAL], "gRPC reference: the internal worker API")
    lines += ["The internal API is what the gateway calls on its workers; clients never call it, and a "
              "worker's port admits only the internal token (see [Security](security.md)). It may change "
              "between versions without notice.", ""]
    return "\n".join(lines)


def main() -> None:
    import mkdocs_gen_files
    with mkdocs_gen_files.open(PAGE, "r+") as page:
        text = page.read()
        if MARKER not in text:
            raise SystemExit(f"docs/{PAGE} has no line {MARKER!r} to put the gRPC reference at")
        page.seek(0)
        page.write(text.replace(MARKER, render()))
        page.truncate()


if __name__ == "__main__":
    print(render())
else:  # run by mkdocs-gen-files (runpy gives the script another __name__)
    main()
