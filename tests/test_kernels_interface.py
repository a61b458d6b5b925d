"""The C kernels' interface is written once, in tiergen/kernels/tiergen.h: no .c file declares
a ``tg_`` function again, the compiler holds every definition to the header, the library
exports what it declares, and the Python side (the ctypes bindings derived from it, every
call of a ``tg_`` function, the Structures that mirror its structs) agrees with it."""

from __future__ import annotations

import ast
import ctypes
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tiergen import kernels
from tiergen.kernels import header
from tiergen.kernels import layer as klayer

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tiergen" / "kernels"
PYTHON = [*(ROOT / "tiergen").rglob("*.py"), *(ROOT / "tests").glob("*.py"),
          *(ROOT / "benchmarks").glob("*.py")]
DECLARED = header.prototypes()
# the Structures of kernels/layer.py, by the header's name of the struct each mirrors
STRUCTURES = {"tg_layer": klayer._Layer, "tg_step": klayer.Step, "tg_mla": klayer._Mla,
              "tg_router": klayer._Router}


def _code(path: Path) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", path.read_text(), flags=re.S)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which(
        "clang")


def test_the_reader_finds_every_declaration():
    names = set(re.findall(r"\b(tg_\w+)\s*\(", _code(header.HEADER)))
    assert names == set(DECLARED)
    assert DECLARED["tg_tile_bytes"] == header.Prototype("tg_tile_bytes", "int64_t",
                                                         ("int64_t", "int64_t"))
    assert DECLARED["tg_int8_isa"].params == ()
    assert DECLARED["tg_rms_norm"].returns == "void"
    assert DECLARED["tg_route"].params[12] == "float"


def test_the_reader_reads_the_forms_c_allows_and_refuses_what_it_does_not_know():
    text = """typedef const int64_t *tg_m;
    typedef struct { int64_t a, b; /* c */ const float *c, *d; tg_m e; } tg_s;
    float *tg_a(const tg_s *s, const int64_t *const *t,
                tg_m m, double x);  /* tg_not(int x); */
    void tg_b(void);"""
    assert header.prototypes(text) == {
        "tg_a": header.Prototype("tg_a", "pointer", ("pointer", "pointer", "pointer", "double")),
        "tg_b": header.Prototype("tg_b", "void", ())}
    assert header.structures(text) == {"tg_s": [("a", "int64_t"), ("b", "int64_t"),
                                                ("c", "pointer"), ("d", "pointer"),
                                                ("e", "pointer")]}
    with pytest.raises(ValueError, match="does not know"):
        header.prototypes("long tg_c(size_t n);")
    with pytest.raises(ValueError, match="twice"):
        header.prototypes("int tg_d(int a);\nint tg_d(int a);")


def test_no_c_file_declares_the_interface_again():
    for path in sorted(KERNELS.glob("*.c")):
        code = _code(path)
        assert '#include "tiergen.h"' in code, path.name
        prototypes = re.findall(r"^[ \t]*(?!return\b|else\b)(?:\w+[ \t*]+)+(tg_\w+)\s*\([^;{}]*\)"
                                r"\s*;", code, re.M)
        assert prototypes == [], f"{path.name} declares {prototypes}: tiergen.h declares them"
        assert re.findall(r"\}\s*(tg_\w+)\s*;", code) == [], path.name


# each instruction set's headers (kernels/int8/): AVX2, AVX-512 without and with VNNI, none
MARCHES = ["-march=native", "-march=haswell", "-march=skylake-avx512", "-march=icelake-server",
           "-march=x86-64"]


@pytest.mark.parametrize("march", MARCHES if platform.machine() in ("x86_64", "AMD64")
                         else ["-mcpu=native"])
def test_every_definition_is_declared_and_as_defined(march):
    """Every build's functions are declared before use: the exported ones in tiergen.h, the
    rest static (GCC 14 refuses an implicit declaration)."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler")
    flags = [f for f in kernels.FLAGS if f.startswith(("-f", "-std")) and f != "-fPIC"]
    done = subprocess.run([cc, march, *flags, "-fsyntax-only", "-Werror=missing-prototypes",
                           "-Werror=implicit-function-declaration", "-Wno-psabi",
                           *map(str, kernels.SOURCES)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_library_exports_what_the_header_declares():
    lib = kernels.library()
    if lib is None:
        pytest.skip("no C kernels here")
    assert [n for n in DECLARED if not hasattr(lib, n)] == []
    nm = shutil.which("nm")
    if nm is not None:
        listed = subprocess.run([nm, "-D", "--defined-only", lib._name], capture_output=True,
                                text=True, timeout=60).stdout
        assert set(re.findall(r"\bT (tg_\w+)$", listed, re.M)) == set(DECLARED)


def test_the_bindings_are_the_headers():
    lib = kernels.library()
    if lib is None:
        pytest.skip("no C kernels here")
    for name, proto in DECLARED.items():
        fn = getattr(lib, name)
        assert (fn.argtypes, fn.restype) == (proto.argtypes(), proto.restype()), name
    assert lib.tg_tile_bytes.restype is ctypes.c_int64 and lib.tg_glu.restype is None
    assert lib.tg_decode_attention.argtypes[12] is ctypes.c_float


def test_only_bind_sets_argument_types():
    """Another binding would be a second copy of the interface (benchmarks may bind the
    libraries of other revisions, whose interface this header need not describe)."""
    setters = []
    for path in (ROOT / "tiergen").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            for t in node.targets if isinstance(node, ast.Assign) else []:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(e, ast.Attribute) and e.attr in ("argtypes", "restype"):
                        setters.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert setters and all(s.startswith("tiergen/kernels/__init__.py") for s in setters), setters


def test_every_call_names_a_declared_function_with_its_arguments():
    wrong, calls = [], 0
    for path in PYTHON:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr.startswith("tg_")):
                continue
            calls += 1
            proto, where = DECLARED.get(node.func.attr), f"{path.relative_to(ROOT)}:{node.lineno}"
            if proto is None:
                wrong.append(f"{where}: {node.func.attr} is not declared")
            elif (not any(isinstance(a, ast.Starred) for a in node.args)
                    and len(node.args) != len(proto.params)):
                wrong.append(f"{where}: {len(node.args)} arguments to {proto.name}, which "
                             f"takes {len(proto.params)}")
    assert calls > 20 and wrong == []


def test_the_structures_mirror_the_headers():
    structs = header.structures()
    assert set(structs) == set(STRUCTURES)
    for name, cls in STRUCTURES.items():
        fields = [(n, header.ctypes_type(kind)) for n, kind in structs[name]]
        assert list(cls._fields_) == fields, name
