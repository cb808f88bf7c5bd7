"""A CPU machine made to look like a machine with a GPU to torch, for tests/unit/test_cuda_free_parent.py.

On this directory's PYTHONPATH with ``DSF_FAKE_GPU_LOG`` set, every interpreter started (the
pytest process, the DistributedTest worker server) imports torch and: reports
``DSF_FAKE_GPUS`` GPUs (``torch.cuda.is_available``/``device_count`` as torch answers them: NVML,
or the CUDA runtime's device count), says torch was built with CUDA, and appends a JSON line to the log for every request to initialise CUDA (the lazy
initialisation that CUDA tensors and device queries go through, the runtime device count),
naming the process (pid, start pid, command line, RANK) and the running test.
Then the request goes on as it would on the CPU build: it fails ("no CUDA here").
"""
import os
import sys

_LOG = os.environ.get("DSF_FAKE_GPU_LOG")
if _LOG and "resource_tracker" not in " ".join(getattr(sys, "orig_argv", sys.argv)):
    import json
    import traceback

    import torch

    _START = os.getpid()
    _N = int(os.environ.get("DSF_FAKE_GPUS", "1"))

    def _record(what):
        entry = {"what": what, "pid": os.getpid(), "start_pid": _START, "rank": os.environ.get("RANK"),
                 "argv": " ".join(getattr(sys, "orig_argv", sys.argv)), "test": os.environ.get("PYTEST_CURRENT_TEST"),
                 "stack": "".join(traceback.format_stack(limit=14)[:-1])}
        with open(_LOG, "a") as f:
            f.write(json.dumps(entry) + "\n")

    _lazy = torch.cuda._lazy_init

    def _fake_lazy_init():
        _record("torch.cuda._lazy_init")
        return _lazy()  # the CPU build's: "Torch not compiled with CUDA enabled"

    for _name, _mod in list(sys.modules.items()):
        if (_name == "torch.cuda" or _name.startswith("torch.cuda.")) and getattr(_mod, "_lazy_init", None) is _lazy:
            _mod._lazy_init = _fake_lazy_init

    def _fake_runtime_device_count():
        _record("cudaGetDeviceCount (torch.cuda.is_available without PYTORCH_NVML_BASED_CUDA_CHECK=1)")
        return _N

    def _fake_is_available():  # torch's logic: NVML where asked for, else the CUDA runtime (cuInit)
        return (_N if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1" else _fake_runtime_device_count()) > 0

    # (torch._C stays as the CPU build has it: torch takes its CUDA-only attributes for a CUDA build)
    torch.cuda.is_available = _fake_is_available
    torch.cuda.device_count = lambda: _N  # NVML's answer
    torch.cuda._device_count_nvml = lambda: _N
    torch.backends.cuda.is_built = lambda: True
