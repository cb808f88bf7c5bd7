"""Benchmarks: ``python -m deepspeed_fused.bench SUITE [SUITE ...]`` (see ``__main__``).

``common`` is the harness (timing, records, the result files); one module per suite. They run
from an installed package as from a clone: the end-to-end suites launch the example job as
``deepspeed_fused.train`` with the configs shipped in the package, and results go to ``--out``
(default ``docs/benchmarks/`` under the current directory).
"""
