"""The options object: declared once, every argument check and environment variable resolved once (single process)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mpi_gradreducer import Options
from mpi_gradreducer._core import options as config
from mpi_gradreducer._core.planning import ParamSpec

SPECS = (ParamSpec((3, 2), np.dtype(np.float32)), ParamSpec((4,), np.dtype(np.float64)))
DEFAULTS = Options(bucket_bytes=1 << 20, timeout=None, progress="deferred")


def resolve(size: int = 4, **changes) -> Options:
    return config.resolve(DEFAULTS.replace(**changes), SPECS, size)


def test_defaults_are_resolved_from_the_arguments_and_the_size(monkeypatch: pytest.MonkeyPatch):
    for name in (config.STALL_WARNING_ENV, config.ABORT_ON_EXCEPTION_ENV, config.TIMELINE_ENV, config.TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)
    o = resolve(timeout="env")
    assert (o.divisor(4), o.fixed_degree, o.ids, o.skipped) == (4, False, (1, 1), (False, False))
    assert o.timeout == config.DEFAULT_TIMEOUT and o.stall_warning == config.DEFAULT_STALL_WARNING == 60.0
    assert o.abort_on_exception is True and o.timeline is None and o.cap == 1 << 20
    assert o.divisor(3) == 3 and resolve(degree=8).divisor(3) == 8
    assert resolve(bucket_bytes="auto").cap is None


def test_environment_variables_give_the_defaults(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(config.TIMEOUT_ENV, "7")
    monkeypatch.setenv(config.STALL_WARNING_ENV, " None ")
    monkeypatch.setenv(config.ABORT_ON_EXCEPTION_ENV, "0")
    monkeypatch.setenv(config.TIMELINE_ENV, "trace.json")
    o = resolve(timeout="env")
    assert (o.timeout, o.stall_warning, o.abort_on_exception, o.timeline) == (7.0, None, False, "trace.json")
    monkeypatch.setenv(config.STALL_WARNING_ENV, "0.5")
    assert resolve().stall_warning == 0.5
    monkeypatch.setenv(config.STALL_WARNING_ENV, "later")
    with pytest.raises(ValueError, match=rf"{config.STALL_WARNING_ENV}: expected a positive number"):
        resolve()


@pytest.mark.parametrize("name, value, pattern", [
    ("degree", 0, r"degree: expected a positive int, got 0"),
    ("degree", True, r"degree: expected a positive int, got True"),
    ("degree", 2.0, r"degree: expected a positive int, got 2.0"),
    ("bucket_bytes", -1, r"bucket_bytes: expected a positive int or 'auto', got -1"),
    ("bucket_bytes", "big", r"bucket_bytes: expected a positive int or 'auto', got 'big'"),
    ("timeout", 0, r"timeout: expected a positive number of seconds or None, got 0"),
    ("timeout", float("nan"), r"timeout: expected a positive number of seconds or None, got nan"),
    ("stall_warning", -2, r"stall_warning: expected a positive number of seconds or None, got -2"),
    ("stall_warning", "soon", r"stall_warning: expected a positive number of seconds or None, got 'soon'"),
    ("validate", "sometimes", r"validate: expected one of \('always', 'first', 'never'\), got 'sometimes'"),
    ("progress", "eager", r"progress: expected one of \('auto', 'thread', 'deferred'\), got 'eager'"),
    ("skip", [True], r"skip: expected 2 bools \(one per parameter\), got 1"),
    ("predivide", 2.0, r"predivide: only applies with compression"),
])
def test_a_bad_argument_is_named_with_what_came(name, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve(**{name: value})


@pytest.mark.parametrize("name, value, pattern", [
    ("mean", 1, r"mean: expected a bool, got int 1"),
    ("cuda_aware", "yes", r"cuda_aware: expected a bool or None, got str 'yes'"),
    ("fusion_type", 1.5, r"fusion_type: expected an int, got float 1.5"),
    ("elsewhere", ["engine"], r"elsewhere: expected a callable that returns strings, or None, got list \['engine'\]"),
])
def test_a_wrong_type_is_a_type_error(name, value, pattern):
    with pytest.raises(TypeError, match=pattern):
        resolve(**{name: value})


def test_positive_is_the_one_number_check():
    assert config.positive("n", 3, integer=True) == 3 and config.positive("t", 0.5) == 0.5
    assert config.positive("t", None, none=True) is None
    for bad in (0, -1, True, "3", float("nan"), None):
        with pytest.raises(ValueError, match=r"^n: expected a positive"):
            config.positive("n", bad, integer=True)


def test_parameters_are_described_by_shape_dtype_and_device():
    specs = config.param_specs(iter([np.zeros((2, 3), np.float32), np.zeros(4, np.complex64)]))  # any iterable
    assert [(s.shape, s.dtype.name, s.device) for s in specs] == [((2, 3), "float32", "cpu"),
                                                                  ((4,), "complex64", "cpu")]
    with pytest.raises(TypeError, match=r"parameters\[1\]: dtype int32 is not supported"):
        config.param_specs([np.zeros(2, np.float32), np.zeros(2, np.int32)])
    with pytest.raises(TypeError, match=r"parameters\[0\]: expected a numpy or cupy array, got str"):
        config.param_specs(["w"])


def test_the_signature_names_what_differs():
    rows, names = config.signature(resolve(), SPECS)
    agreed = [f.name for f in dataclasses.fields(Options) if "agree" in f.metadata]
    assert names == [f"option {n}" for n in agreed] + ["the number of parameters", "parameter 0", "parameter 1"]
    assert config._describe(names[-1], rows[-1]) == "shape (4,) float64 on cpu (fusion id 1)"
    assert config._describe("option mean", rows[agreed.index("mean")]) == "True"
    assert config.signature(resolve(skip=[False, True]), SPECS)[0][-1] != rows[-1]
    for change in (dict(check_finite=True), dict(coalesce=True), dict(timeline="t.json"), dict(degree=4),
                   dict(degree=3), dict(mean=False), dict(compression="fp16"), dict(deterministic=True)):
        assert config.signature(resolve(**change), SPECS)[0] != rows, change  # options that change messages
    for local in (dict(validate="first"), dict(timeout=5.0), dict(stall_warning=None)):
        assert config.signature(resolve(**local), SPECS)[0] == rows, local  # each rank's own


def test_options_are_declared_once_and_refuse_unknown_names():
    o = Options(compression="fp16")
    assert o.replace(bucket_bytes="auto") == Options(compression="fp16", bucket_bytes="auto")
    assert o.replace() is o
    with pytest.raises(TypeError, match=r"unexpected option 'compresion'; the options are: .*compression"):
        o.replace(compresion="bf16")
    with pytest.raises(TypeError, match=r"options: expected a mpi_gradreducer.Options, got dict"):
        config.resolve({"mean": True}, SPECS, 4)  # type: ignore[arg-type]
    resolved = resolve(timeout="env", compression="fp16")
    assert config.resolve(resolved, SPECS, 4) == resolved  # resolved options build the same reducer again
