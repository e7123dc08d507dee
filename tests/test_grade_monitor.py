"""The reference watch: a reference's source compiled again in any way (optimize levels, with or
without `from __future__ import annotations`, through ast), and its code object copied with its
tables or line numbers changed, are recognised, and nothing else is: no function of torch, the
standard library or IPython looks like a copy of a reference."""

import dis
import gc
import inspect
import types

from qwen_mini.course.checking import exercises
from qwen_mini.course.grading.monitor import (
    Snapshot,
    _codes,
    _instructions,
    exact,
    fingerprint,
    size,
)
from qwen_mini.course.grading.sandbox import _chapter_spec
from qwen_mini.course.grading.worker import _references

CHAPTERS = [f"ch{n:02d}" for n in range(8)]


def test_recompiled_copies_of_a_reference_are_recognised():
    from qwen_mini import rope

    snap = Snapshot(exercises("ch00"))
    source = inspect.getsource(rope.rope_cos_sin)
    for optimize in (0, 1, 2):
        for flags in (0, 0x1000000):  # __future__.annotations
            namespace = {"torch": __import__("torch")}
            exec(compile(source, "<cell 1>", "exec", flags, True, optimize), namespace)
            code = namespace["rope_cos_sin"].__code__
            assert fingerprint(code) in snap.fingerprints["ch00.rope_cos_sin"], (optimize, flags)


def test_copies_of_a_reference_with_other_tables_are_recognised():
    from qwen_mini import rope

    snap = Snapshot(exercises("ch00"))
    code = rope.rope_cos_sin.__code__
    nop = bytes([dis.opmap["NOP"], 0])
    copies = {
        "an unused constant": code.replace(co_consts=(*code.co_consts, "unused")),
        "an unused name": code.replace(co_names=(*code.co_names, "unused")),
        "locals renamed": code.replace(co_varnames=tuple(f"v{i}" for i in range(code.co_nlocals))),
        "constants reordered": code.replace(
            co_consts=code.co_consts[::-1], co_code=_reindexed_consts(code)
        ),
        "a no-op, no line table": code.replace(
            co_code=code.co_code[:2] + nop + code.co_code[2:], co_linetable=b""
        ),
    }
    for what, copy in copies.items():
        assert fingerprint(copy) in snap.fingerprints["ch00.rope_cos_sin"], what
    # what the code does is what counts: another constant is another function
    other = code.replace(co_consts=tuple(2.5 if c == 1.0 else c for c in code.co_consts))
    assert other.co_consts != code.co_consts
    assert fingerprint(other) not in snap.fingerprints["ch00.rope_cos_sin"]


def test_the_instruction_count_read_from_the_bytecode_is_the_disassemblys():
    """The watcher disassembles only a code object whose `size` is one of a reference's: the
    count must be that of the instructions a fingerprint is made of, for every code object (else
    a copy would be passed over). torch's functional API, the standard library's json and
    argparse, the package, and copies with no-ops and with arguments over 255 (EXTENDED_ARG)."""
    import argparse
    import json

    import torch.nn.functional

    import qwen_mini.decoder

    codes = [
        c
        for module in (torch.nn.functional, json.decoder, argparse, qwen_mini.decoder)
        for value in vars(module).values()
        for c in _codes(value)
    ]
    source = "def f(x):\n    return [" + ", ".join(f"x + {i}" for i in range(300)) + "]\n"
    wide = _codes(compile(source, "<wide>", "exec"))[-1]
    assert wide.co_code[::2].count(dis.opmap["EXTENDED_ARG"]) > 0
    nop = bytes([dis.opmap["NOP"], 0])
    codes += [wide, wide.replace(co_code=nop * 3 + wide.co_code, co_linetable=b"")]
    assert len(codes) > 500
    for code in codes:
        assert size(code) == len(_instructions(code)), code.co_qualname


def _reindexed_consts(code):
    """co_code with every instruction that reads co_consts pointing into it reversed."""
    out = bytearray(code.co_code)
    last = len(code.co_consts) - 1
    for i in range(0, len(out), 2):
        if out[i] in dis.hasconst:
            out[i + 1] = last - out[i + 1]
    return bytes(out)


def test_no_foreign_function_looks_like_a_reference():
    # the earlier chapters' classes as the worker gets them from the grader
    snaps = {
        ch: Snapshot(exercises(ch), earlier=_references(_chapter_spec(ch))[1]) for ch in CHAPTERS
    }
    # both digests begin with the instruction count (`size`): only a code object as long as one
    # of a reference's can share a digest with it, so only those are digested (as the watcher does)
    sizes = {n for snap in snaps.values() for counts in snap.sizes.values() for n in counts}
    foreign, seen = {}, 0
    for obj in gc.get_objects():
        module = getattr(obj, "__module__", None)
        module = module if isinstance(module, str) else ""
        # the tests' own wrong answers are written to resemble the references: not foreign
        ours = module.startswith(("qwen_mini", "test_", "tests.", "helpers", "conftest"))
        if isinstance(obj, types.FunctionType) and not ours:
            for code in _codes(obj.__code__):
                seen += 1
                if size(code) in sizes:
                    foreign.setdefault(exact(code), code.co_qualname)
                    foreign.setdefault(fingerprint(code), code.co_qualname)
    assert seen > 20000 and len(foreign) > 5000  # torch, the standard library, IPython
    for snap in snaps.values():
        for exercise, prints in snap.fingerprints.items():
            assert not [foreign[f] for f in prints if f in foreign], exercise
