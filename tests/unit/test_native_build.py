"""The RMSNorm C++ node's build runs in a child process, never in a thread of the calling process:
the first calls return at once (the Python node serves), a later call takes the finished child's
library, a failed child build warns once and leaves the Python node; ``get(wait=True)`` waits."""
import os
import shutil
import sys
import textwrap
import threading
import time
import warnings

import pytest

from deepspeed_fused.ops.rms_norm import native as _native


@pytest.fixture
def fresh_state(monkeypatch):
    """A process where the node was never built, with CUDA (as far as ``enabled`` asks)."""
    for k in ("mod", "thread", "error"):
        monkeypatch.setitem(_native._state, k, None)
    monkeypatch.setitem(_native._state, "cuda", True)
    monkeypatch.setattr(_native, "interpreter_active", lambda: False)
    monkeypatch.delenv(_native.ENV, raising=False)
    yield
    t = _native._state["thread"]
    if t is not None:
        t.join()


def _fake_child(monkeypatch, tmp_path, seconds, body="init_driver = lambda: True\nregister_rms_plan = print\n"):
    """The child replaced by one that sleeps, then names a small module (a stand-in for the built library)."""
    lib = tmp_path / "fake_node.py"
    lib.write_text(body)
    child = textwrap.dedent(f"""
        import sys, time
        time.sleep({seconds})
        assert sys.argv[1] == {_native._NAME!r} and sys.argv[2].endswith("rms_norm_node.cpp")
        print({str(lib)!r})
    """)
    monkeypatch.setattr(_native, "_CHILD", child)


def test_first_calls_do_not_wait_for_the_build(fresh_state, monkeypatch, tmp_path):
    _fake_child(monkeypatch, tmp_path, 2.0)
    threads = threading.active_count()
    t0 = time.perf_counter()
    assert _native.get() is None  # the Python node serves
    assert time.perf_counter() - t0 < 1.0
    t = _native._state["thread"]
    assert isinstance(t, _native._BuildProcess) and t.pid != os.getpid()
    assert threading.active_count() == threads  # no thread here: the build is another process
    assert _native.building()
    # calls while it builds: each a waitpid, no import, no lock held for long
    worst = 0.0
    n = 0
    while _native.building() and n < 200:
        t1 = time.perf_counter()
        assert _native.get() is None
        worst = max(worst, time.perf_counter() - t1)
        n += 1
        time.sleep(0.005)
    assert n >= 20 and worst < 0.05, (n, worst)
    t.join()
    mod = _native.get()  # the first call after the child is done takes its library
    assert mod is not None and mod.init_driver() and _native.error() is None
    assert _native.get() is mod and not _native.building()


def test_wait_waits_for_the_child(fresh_state, monkeypatch, tmp_path):
    _fake_child(monkeypatch, tmp_path, 0.5)
    assert _native.get() is None
    mod = _native.get(wait=True)
    assert mod is not None and not _native.building()


def test_failed_child_build_warns_once_and_keeps_the_python_node(fresh_state, monkeypatch):
    monkeypatch.setattr(_native, "_CHILD", "import sys\nsys.stderr.write('no compiler here')\nsys.exit(3)\n")
    assert _native.get() is None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert _native.get(wait=True) is None
        assert _native.get() is None
    assert len([x for x in w if "could not be built" in str(x.message)]) == 1
    assert "exited with 3" in _native.error() and "no compiler here" in _native.error()
    assert not _native.enabled()


def test_driver_missing_in_the_built_library_is_a_failed_build(fresh_state, monkeypatch, tmp_path):
    _fake_child(monkeypatch, tmp_path, 0.1, body="init_driver = lambda: False\n")
    assert _native.get() is None
    with pytest.warns(RuntimeWarning, match="libcuda"):
        assert _native.get(wait=True) is None
    assert "libcuda" in _native.error()


def test_the_child_builds_the_real_node(fresh_state, monkeypatch):
    """The child script as shipped: torch's cpp_extension builds (or loads the cached build of) the
    node's source and names its library, which this process then imports."""
    if shutil.which("ninja") is None or shutil.which("c++") is None:
        pytest.skip("no C++ compiler or ninja")
    monkeypatch.setattr(_native, "_check_driver", lambda mod: mod)  # no libcuda on a CPU-only machine
    assert _native.get() is None
    mod = _native.get(wait=True)
    assert mod is not None, _native.error()
    assert callable(mod.register_rms_plan) and callable(mod.rms_norm) and isinstance(mod.init_driver(), bool)
    assert _native._NAME in sys.modules or mod.__name__ == _native._NAME
