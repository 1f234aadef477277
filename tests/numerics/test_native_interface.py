"""The native interface in two languages: kernels.h's descriptor structs against their ctypes
mirrors (sizes and offsets as the compiled library reports them), its prototypes against the
signature table."""

import ctypes
import re
from pathlib import Path

import pytest

from dynquant.numerics import native
from dynquant.numerics.native import interface

HEADER = Path(native.__file__).parent / "kernels.h"
C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "void": None}

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")


@pytest.mark.parametrize("struct", interface.DESCRIPTORS, ids=lambda s: s.c_name)
def test_every_descriptor_is_laid_out_as_the_library_compiled_it(struct):
    lib, name = native.library(), struct.c_name.encode()
    assert lib.dq_layout(name, b"") == ctypes.sizeof(struct)
    assert lib.dq_layout_fields(name) == len(struct._fields_)
    for field, _ in struct._fields_:
        assert lib.dq_layout(name, field.encode()) == getattr(struct, field).offset, field


def test_the_layout_query_refuses_unknown_names():
    lib = native.library()
    assert lib.dq_layout(b"dq_product", b"no_such_field") == -1
    assert lib.dq_layout(b"no_such_struct", b"") == -1
    assert lib.dq_layout_fields(b"no_such_struct") == -1


def _prototypes() -> dict[str, tuple[str, list[str]]]:
    """kernels.h's function declarations: name -> (result type, parameter declarations)."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    text = re.sub(r"^#.*?(?<!\\)$", "", text, flags=re.M | re.S)
    found = {}
    for result, name, params in re.findall(r"\b(int64_t|int|void)\s+(dq_\w+)\(([^)]*)\);", text):
        parts = [" ".join(p.split()) for p in params.split(",")]
        found[name] = (result, [] if parts == ["void"] else parts)
    return found


def _expected(param: str) -> type | None:
    """The ctypes type a C parameter declaration calls for (pointers: see the test)."""
    if "*" in param:
        struct = next((s for s in interface.DESCRIPTORS if s.c_name in param), None)
        return ctypes.POINTER(struct) if struct else ctypes.c_void_p
    return C_TYPES[param.split()[-2] if len(param.split()) > 1 else param]


def test_every_prototype_has_its_signature_and_no_other():
    prototypes = _prototypes()
    assert len(prototypes) > 30  # the parse found the header's declarations
    assert set(prototypes) == set(interface.SIGNATURES)
    for name, (result, params) in prototypes.items():
        restype, argtypes = interface.SIGNATURES[name]
        assert restype is C_TYPES[result], name
        assert len(argtypes) == len(params), name
        for param, argtype in zip(params, argtypes, strict=True):
            want = _expected(param)
            if want is ctypes.c_void_p:  # data pointers; strings are char pointers
                want = ctypes.c_char_p if param.startswith("const char") else want
            assert argtype is want, f"{name}: {param} bound as {argtype.__name__}"
        fn = getattr(native.library(), name)
        assert (fn.restype, list(fn.argtypes)) == (restype, argtypes), name


def test_no_descriptor_is_read_by_position():
    """The descriptors are read by field name in both languages: no argument block indexed by
    number (an ``args`` or ``L`` subscript) remains in the repository's Python or C."""
    root = Path(__file__).parents[2]
    indexed = re.compile(r"\b(?:args|L)\[")
    files = [p for folder in ("src", "tests", "benchmarks", "scripts")
             for pattern in ("*.py", "*.c", "*.h") for p in (root / folder).rglob(pattern)]
    hits = [f"{path.relative_to(root)}:{n}: {line.strip()}" for path in sorted(files)
            for n, line in enumerate(path.read_text().splitlines(), 1) if indexed.search(line)]
    assert hits == []
