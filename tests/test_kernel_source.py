"""The batched-copy kernel's source and its arithmetic, checked without a GPU.

The bfloat16 conversions of the kernel are integer formulas; here they are
re-implemented in numpy, with the same constants, and compared with ml_dtypes
over every bfloat16 bit pattern and many float32 values.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpi_gradreducer._core import backend

ml_dtypes = pytest.importorskip("ml_dtypes")


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """The kernel's ``bf16_to_f32``: a 16-bit shift."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """The kernel's ``f32_to_bf16``: round to nearest even by integer arithmetic, NaN kept and quiet."""
    u = values.astype(np.float32).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x0040), rounded).astype(np.uint16)


def test_the_numpy_formulas_are_the_kernels():
    src = backend.kernel_source("bfloat16", "float32")
    assert "bits_to_f32(((unsigned int)b) << 16)" in src
    assert "if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);" in src
    assert "u += 0x7fffu + ((u >> 16) & 1u);" in src


def test_bf16_to_f32_matches_ml_dtypes_on_all_65536_patterns():
    bits = np.arange(1 << 16, dtype=np.uint16)
    ours = bf16_to_f32(bits)
    theirs = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # NaN payloads and signed zeros too


def _float32_samples() -> np.ndarray:
    rng = np.random.default_rng(7)
    random_bits = rng.integers(0, 1 << 32, size=2_000_000, dtype=np.uint64).astype(np.uint32)
    # every bfloat16 value, and the float32 values around each halfway point between two of them
    base = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    near_half = (base[:, None] + np.array([0x7FFF, 0x8000, 0x8001, 0xFFFF, 1], np.uint32)).ravel()
    denormals = np.arange(0, 1 << 23, 97, dtype=np.uint32)
    special = np.array([0x7F7FFFFF, 0x7F7F8000, 0xFF7F8000, 0x7F800000, 0xFF800000, 0x00800000,
                        0x007FFFFF, 0x80000001], np.uint32)
    bits = [random_bits, base, near_half, denormals, denormals | np.uint32(1 << 31), special]
    return np.concatenate(bits).view(np.float32)


def test_f32_to_bf16_matches_ml_dtypes_round_to_nearest_even():
    values = _float32_samples()
    ours = f32_to_bf16(values)
    with np.errstate(over="ignore", invalid="ignore"):
        theirs = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(ours[~nan], theirs[~nan])
    # NaN stays NaN, with its sign and the top of its payload; the quiet bit is set.
    back = bf16_to_f32(ours[nan])
    assert np.isnan(back).all()
    assert np.array_equal(np.signbit(back), np.signbit(values[nan]))
    assert np.array_equal(ours[nan] & 0x3F, (values[nan].view(np.uint32) >> 16).astype(np.uint16) & 0x3F)
    assert (ours[nan] & 0x40).all()


def test_denormals_survive_both_bfloat16_conversions():
    tiny = np.array([1e-40, -3e-39, 1.1e-38], np.float32)  # float32 denormals, bfloat16 denormals too
    assert (tiny != 0).all() and (np.abs(tiny) < np.finfo(np.float32).tiny).all()
    round_trip = bf16_to_f32(f32_to_bf16(tiny))
    assert (round_trip != 0).all()  # not flushed to zero
    assert np.array_equal(round_trip, tiny.astype(ml_dtypes.bfloat16).astype(np.float32))


def _defines(src: str) -> dict[str, str]:
    return dict(re.findall(r"^#define (\w+)(?:\(.*?\))? (.*)$", src, flags=re.M))


STORAGE = {"float16": "unsigned short", "bfloat16": "unsigned short", "float32": "float", "float64": "double"}
READ = {"float16": "f16_to_f32((x))", "bfloat16": "bf16_to_f32((x))", "float32": "(x)", "float64": "(x)"}


@pytest.mark.parametrize("wire", backend.KERNEL_DTYPES)
@pytest.mark.parametrize("item", backend.KERNEL_DTYPES)
def test_kernel_defines_for_every_dtype_pair(item, wire):
    d = _defines(backend.kernel_source(item, wire))
    compute = "double" if "float64" in (item, wire) else "float"
    assert d["ITEM"] == STORAGE[item] and d["WIRE"] == STORAGE[wire] and d["COMPUTE"] == compute
    assert d["MUL"] == ("mul_f64((a), (b))" if compute == "double" else "mul_f32((a), (b))")
    assert d["SCALE"] == ("(x)" if compute == "double" else "f64_to_f32(x)")
    for name, (get, put) in (item, ("FROM_ITEM", "TO_ITEM")), (wire, ("FROM_WIRE", "TO_WIRE")):
        widen = compute == "double" and name != "float64"
        assert d[get] == (f"f32_to_f64({READ[name]})" if widen else READ[name])
        if name == "float16":
            assert d[put] == ("f64_to_f16((x))" if widen else "f32_to_f16((x))")
        elif name == "bfloat16":
            assert d[put] == ("f32_to_bf16(f64_to_f32(x))" if widen else "f32_to_bf16((x))")
        else:
            assert d[put] == ("f64_to_f32(x)" if widen else "(x)")


def test_kernel_needs_no_header_and_keeps_denormals():
    src = backend.kernel_source("float32", "float32")
    assert "#include" not in src
    body = src[src.index('extern "C"'):]
    # values are scaled only through MUL (inline PTX without .ftz), and only when the scale is not 1
    assert body.count("scaled ? MUL(v, s) : v") == 2
    assert not re.search(r"\bv\s*\*|\*\s*s\b|\*\s*\(COMPUTE\)", body)
    ptx = re.findall(r'asm\("([^"]*)"', src)
    assert ptx and not any(".ftz" in p for p in ptx)
    assert {p.split()[0] for p in ptx} == {"cvt.f32.f16", "cvt.rn.f16.f32", "cvt.rn.f16.f64", "mov.b32",
                                           "cvt.f64.f32", "cvt.rn.f32.f64", "mul.rn.f32", "mul.rn.f64"}


def test_compile_options_do_not_try_to_undo_cupys_flush_to_zero():
    # cupy appends -ftz=true after the caller's options and NVRTC keeps the last,
    # so a -ftz=false here would only earn a warning: denormals are kept by PTX instead.
    assert isinstance(backend.KERNEL_OPTIONS, tuple)
    assert not any("ftz" in o or "fast_math" in o or "fast-math" in o for o in backend.KERNEL_OPTIONS)


def test_unknown_dtype_is_named():
    with pytest.raises(KeyError, match="int32"):
        backend.kernel_source("int32", "float32")
