"""The C kernels' interface read from ``tiergen.h``, where it is written once: the functions'
prototypes (whose ctypes argument and return types :func:`tiergen.kernels.bind` derives from
them, so that no third copy of the interface can drift) and the structures they take.

A small reader for the plain C that header keeps to (see its opening comment), not a C
parser: a type it does not know fails loudly, here and in tests/test_kernels_interface.py.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).with_name("tiergen.h")

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_PROTOTYPE = re.compile(r"^[ \t]*(\w[\w \t*]*?)\b(tg_\w+)\s*\(([^()]*)\)\s*;", re.M)
_STRUCT = re.compile(r"typedef\s+struct\s*\w*\s*\{([^{}]*)\}\s*(\w+)\s*;")
_POINTER_TYPEDEF = re.compile(r"typedef\s+[^;{}]*\*\s*(\w+)\s*;")
# The scalar types the header may use, as ctypes passes them.
SCALARS: dict[str, type | None] = {
    "void": None, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
    "int8_t": ctypes.c_int8, "int16_t": ctypes.c_int16, "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64, "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16,
    "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64,
}
POINTER = "pointer"  # every pointer: ctypes passes addresses as c_void_p


@dataclass(frozen=True)
class Prototype:
    """One declared function: its return type and its parameters' types, each a key of
    :data:`SCALARS` or :data:`POINTER`."""

    name: str
    returns: str
    params: tuple[str, ...]

    def restype(self) -> type | None:
        return ctypes_type(self.returns)

    def argtypes(self) -> list[type]:
        return [ctypes_type(p) for p in self.params]


def ctypes_type(kind: str) -> type | None:
    return ctypes.c_void_p if kind == POINTER else SCALARS[kind]


def _source(text: str | None) -> str:
    return _COMMENT.sub(" ", HEADER.read_text() if text is None else text)


def _kind(declaration: str, pointers: set[str]) -> str:
    """The kind of a declaration's type (a parameter, a return type or a field without its
    name): POINTER, or the scalar's name."""
    words = [w for w in re.findall(r"\w+", declaration) if w not in ("const", "restrict")]
    if "*" in declaration or any(w in pointers for w in words):
        return POINTER
    if len(words) != 1 or words[0] not in SCALARS:
        raise ValueError(f"tiergen.h: a type the reader does not know: {declaration.strip()!r}")
    return words[0]


def _pointer_typedefs(src: str) -> set[str]:
    """Names the header gives pointer types, and its structures' names (passed by address)."""
    return set(_POINTER_TYPEDEF.findall(src)) | {m.group(2) for m in _STRUCT.finditer(src)}


def prototypes(text: str | None = None) -> dict[str, Prototype]:
    """Every ``tg_`` function the header (``text``, else tiergen.h) declares, by name. Its
    parameters are named, as the header writes them: each one's last word is its name."""
    src = _source(text)
    pointers = _pointer_typedefs(src)
    found: dict[str, Prototype] = {}
    for m in _PROTOTYPE.finditer(src):
        returns, name, params = m.group(1), m.group(2), m.group(3).strip()
        if name in found:
            raise ValueError(f"tiergen.h declares {name} twice")
        kinds = () if params == "void" else tuple(
            _kind(re.sub(r"\w+\s*$", "", p), pointers) for p in params.split(","))
        found[name] = Prototype(name, _kind(returns, pointers), kinds)
    return found


def structures(text: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """Every ``typedef struct {...} name;`` of the header: its fields in order, as (name,
    kind), for checking the ctypes Structures that mirror them."""
    src = _source(text)
    pointers = _pointer_typedefs(src)
    found: dict[str, list[tuple[str, str]]] = {}
    for m in _STRUCT.finditer(src):
        fields: list[tuple[str, str]] = []
        for line in filter(None, (s.strip() for s in m.group(1).split(";"))):
            base = re.match(r"((?:const\s+)?\w+)\s*(.*)", line, re.S)
            for name in base.group(2).split(","):
                fields.append((name.strip().lstrip("*").strip(),
                               _kind(base.group(1) + ("*" if "*" in name else ""), pointers)))
        found[m.group(2)] = fields
    return found
