"""The DistributedTest harness itself: ranks, parameters, clean workers, failures and hangs."""
import multiprocessing as mp
import os
import sys
import time

import pytest
import torch

from unit import common
from unit.common import DistributedTest, run_distributed

# Set in the test's own process after import (as a parent touches CUDA after importing torch);
# a worker that starts clean imports this module afresh and sees None, a fork would see the value.
_PARENT_STATE = None


class TestHarnessWorld2(DistributedTest):
    world_size = 2

    def test_ranks_and_allreduce(self):
        import deepspeed.comm as dist

        ws = dist.get_world_size()
        assert ws == type(self).world_size and os.environ["LOCAL_SIZE"] == str(ws)
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        assert t.item() == ws * (ws + 1) / 2

    @pytest.mark.parametrize("value", [1, 2])
    def test_params_reach_ranks(self, value):
        assert value in (1, 2)
        assert _PARENT_STATE is None


class TestHarnessSubclass(TestHarnessWorld2):
    """A subclass setting world_size re-runs the inherited tests at that size."""

    world_size = 1
    test_params_reach_ranks = None  # not re-run here


def _report_state(parent_interpret, q=None):
    from deepspeed_fused.ops import _common

    seen = (_PARENT_STATE, os.environ.get("TRITON_INTERPRET") == parent_interpret,
            _common.interpreter_active() == (parent_interpret == "1"))
    if q is not None:
        q.put(seen)
        return
    assert seen == (None, True, True), seen


def test_workers_start_clean(monkeypatch):
    """The parent marks its own memory after import (the stand-in for having initialised CUDA):
    the ranks do not see the mark, and run the kernels under the parent's TRITON_INTERPRET. A plain fork, for contrast, does see the mark."""
    monkeypatch.setattr(sys.modules[__name__], "_PARENT_STATE", "touched by the parent")
    monkeypatch.setenv("DSF_HARNESS_PROBE", "from the parent")  # set after the worker server started
    interp = os.environ.get("TRITON_INTERPRET")
    run_distributed(_report_state, 2, init_dist=False, parent_interpret=interp)
    run_distributed(_env_probe, 1, init_dist=False)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_report_state, args=(interp, q))
    p.start()
    seen = q.get(timeout=60)
    p.join()
    p.close()
    q.close()
    del p, q
    assert seen[0] == "touched by the parent"


def _env_probe():
    assert os.environ["DSF_HARNESS_PROBE"] == "from the parent"


def _boom():
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("rank one failed")


def _failing_assert():
    rank = int(os.environ["RANK"])
    assert rank + 1 == 5


def _hang():
    if int(os.environ["RANK"]) == 1:
        print("rank one is about to hang", flush=True)
        time.sleep(3600)


def _fail_then_hang():
    if int(os.environ["RANK"]) == 0:
        raise ValueError("rank zero gave up")
    time.sleep(3600)


def _die():
    if int(os.environ["RANK"]) == 0:
        os._exit(3)


class TestHarnessFailure:
    def test_rank_failure_is_reported(self):
        with pytest.raises(pytest.fail.Exception, match=r"(?s)rank 1 ---.*RuntimeError: rank one failed"):
            run_distributed(_boom, 2, init_dist=False)

    def test_failing_assert_is_readable(self):
        with pytest.raises(pytest.fail.Exception) as e:
            run_distributed(_failing_assert, 2, init_dist=False)
        msg = str(e.value)
        assert "rank 0 ---" in msg and "rank 1 ---" in msg
        assert "assert (0 + 1) == 5" in msg and "assert (1 + 1) == 5" in msg, msg

    def test_hung_rank_times_out(self):
        t0 = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match=r"(?s)rank 1 ---\ntimed out after 3s.*about to hang"):
            run_distributed(_hang, 2, timeout=3, init_dist=False)
        assert time.monotonic() - t0 < 60

    def test_other_ranks_killed_after_a_failure(self, monkeypatch):
        monkeypatch.setattr(common, "GRACE_AFTER_FAILURE", 1.0)
        with pytest.raises(pytest.fail.Exception,
                           match=r"(?s)rank 0 ---.*ValueError: rank zero gave up.*rank 1 ---\nkilled after"):
            run_distributed(_fail_then_hang, 2, init_dist=False)

    def test_rank_that_dies_is_reported(self):
        with pytest.raises(pytest.fail.Exception, match=r"rank 0 ---\nexited with code 3 without reporting"):
            run_distributed(_die, 2, init_dist=False, timeout=120)

    def test_unpicklable_function_fails_in_parent(self):
        with pytest.raises(pytest.fail.Exception, match="must pickle"):
            run_distributed(lambda: None, 2, init_dist=False)

    def test_too_few_gpus_skip(self):
        if torch.cuda.device_count() >= 64:
            pytest.skip("a machine with 64 GPUs")
        with pytest.raises(pytest.skip.Exception, match="GPUs required"):
            run_distributed(_boom, 64, backend="nccl")


def _skip_on_every_rank():
    pytest.skip(f"rank {os.environ['RANK']} has nothing to do")


def _skip_on_rank_one_fail_on_zero():
    if int(os.environ["RANK"]) == 1:
        pytest.skip("rank one skips")
    raise ValueError("rank zero failed")


def _world_two_env():
    assert os.environ["WORLD_SIZE"] == "2" and os.environ["RANK"] in ("0", "1")


def _ranks_from_a_worker():
    common.start_worker_server()  # this worker's own server (a fresh interpreter)
    run_distributed(_world_two_env, 2, init_dist=False)


def _start_a_background_build(path):
    import threading

    from deepspeed_fused.ops.rms_norm import native as _native

    def build():  # a daemon thread, as _native.get() starts: it would die with the rank
        time.sleep(1.0)
        with open(path, "w") as f:
            f.write("built")

    _native._state["thread"] = threading.Thread(target=build, daemon=True)
    _native._state["thread"].start()


class TestHarnessOutcomes:
    def test_ranks_finish_the_native_build_they_started(self, tmp_path):
        """torch's extension build holds a lock file: a rank may not exit in the middle of it."""
        run_distributed(_start_a_background_build, 1, init_dist=False, path=str(tmp_path / "built"))
        assert (tmp_path / "built").read_text() == "built"


    def test_a_worker_starts_ranks_of_its_own(self):
        """As tests/gpu/test_harness_gpu.py does after initialising CUDA in its worker."""
        run_distributed(_ranks_from_a_worker, 1, init_dist=False)


    def test_skip_in_the_ranks_skips_the_test(self):
        with pytest.raises(pytest.skip.Exception, match="rank 0 has nothing to do"):
            run_distributed(_skip_on_every_rank, 2, init_dist=False)

    def test_a_failure_beside_a_skip_fails(self):
        with pytest.raises(pytest.fail.Exception, match=r"(?s)rank 0 ---.*ValueError: rank zero failed.*rank 1 ---\n"
                                                         r"skipped: rank one skips"):
            run_distributed(_skip_on_rank_one_fail_on_zero, 2, init_dist=False)

    def test_nccl_ranks_start_on_other_gpus_per_xdist_worker(self, monkeypatch):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
        assert common._visible_devices() == "0,1,2,3"
        for worker, want in (("gw0", "0,1,2,3"), ("gw1", "1,2,3,0"), ("gw6", "2,3,0,1")):
            monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
            assert common._visible_devices() == want

    def test_gpu_tests_share_a_lock_a_heavy_one_holds_alone(self, monkeypatch):
        """Under xdist (a run id), a heavy test holds a lock file no other process can take; a small GPU
        test holds it shared."""
        import fcntl

        monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", f"harness-test-{os.getpid()}")
        path = os.path.join(common.tempfile.gettempdir(), f"deepspeed_fused-gpu-heavy-harness-test-{os.getpid()}.lock")

        def other_can_lock(mode=fcntl.LOCK_EX):
            ctx = mp.get_context("fork")
            q = ctx.Queue()

            def probe():
                with open(path, "w") as f:
                    try:
                        fcntl.flock(f, mode | fcntl.LOCK_NB)
                        q.put(True)
                    except BlockingIOError:
                        q.put(False)

            p = ctx.Process(target=probe)
            p.start()
            got = q.get(timeout=60)
            p.join()
            return got

        try:
            with common.gpu_heavy_lock(True):
                assert not other_can_lock() and not other_can_lock(fcntl.LOCK_SH)
            assert other_can_lock()
            with common.gpu_heavy_lock(False, gpu=True):  # a small GPU test: beside others, not a heavy one
                assert other_can_lock(fcntl.LOCK_SH) and not other_can_lock()
            with common.gpu_heavy_lock(False):  # a CPU test: no lock
                assert other_can_lock()
        finally:
            if os.path.exists(path):
                os.remove(path)
