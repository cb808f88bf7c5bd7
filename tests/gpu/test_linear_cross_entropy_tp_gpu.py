"""Vocabulary- and sequence-parallel linear cross-entropy on NCCL at world size 2 (2 GPUs): every
gloo test of tests/unit/test_linear_cross_entropy_tp.py (equal and ragged shards, per-token
outputs, sequence_parallel, the collective counts, the reference path, the checks) re-run by
subclasses with ``backend = "nccl"``; the test bodies are the unit tests' own."""
import pytest

from unit import test_linear_cross_entropy_tp as tp  # the module, not its classes: pytest collects those

pytestmark = pytest.mark.gpu


class TestVocabParallelNCCL(tp.TestVocabParallel):
    world_size = 2
    backend = "nccl"
    test_subgroups = None  # two TP groups of two ranks: 4 GPUs (the unit test runs it on NCCL where there are)


class TestSequenceParallelNCCL(tp.TestSequenceParallel):
    world_size = 2
    backend = "nccl"
