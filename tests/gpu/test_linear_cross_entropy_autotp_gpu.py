"""The "linear_cross_entropy" feature on a DeepSpeed AutoTP model (autotp_size 2) started by the
deepspeed launcher on 2 GPUs: loss and gradients equal to the unpatched AutoTP model (the checks
of tests/unit/test_linear_cross_entropy_autotp.py, in tests/gpu/autotp_launcher_job.py)."""
import json
import os
import subprocess
import sys

import pytest

from unit.common import DEFAULT_TIMEOUT, NCCL_ENV, _free_port, cuda_device_count
from unit.test_linear_cross_entropy_autotp import CASES

pytestmark = pytest.mark.gpu
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "CROSS_RANK", "CROSS_SIZE")


@pytest.mark.skipif(cuda_device_count() < 2, reason="needs 2 GPUs")
def test_autotp_fused_loss_under_launcher(tmp_path):
    out = tmp_path / "autotp.json"
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}  # this worker's own: the launcher sets its ranks'
    env.update(NCCL_ENV, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
           "tests/gpu/autotp_launcher_job.py", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=DEFAULT_TIMEOUT - 60)  # inside the worker's own limit: the launcher is killed first
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-5000:]}\n{p.stderr[-5000:]}"
    result = json.loads(out.read_text())
    assert result == {"cases": list(CASES), "world_size": 2}, result
