"""The "linear_cross_entropy" feature on a DeepSpeed AutoTP model (autotp_size 2) started by the
deepspeed launcher on 2 GPUs: loss and gradients equal to the unpatched AutoTP model (the checks
of tests/unit/test_linear_cross_entropy_autotp.py, in tests/gpu/autotp_launcher_job.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from unit.common import NCCL_ENV, _free_port
from unit.test_linear_cross_entropy_autotp import CASES

pytestmark = pytest.mark.gpu
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_autotp_fused_loss_under_launcher(tmp_path):
    out = tmp_path / "autotp.json"
    env = {**os.environ, **NCCL_ENV, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
           "tests/gpu/autotp_launcher_job.py", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-5000:]}\n{p.stderr[-5000:]}"
    result = json.loads(out.read_text())
    assert result == {"cases": list(CASES), "world_size": 2}, result
