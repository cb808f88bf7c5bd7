# Convenience targets. The README's two commands are the reference; these wrap them.
PY ?= python

.PHONY: test train gpu-test bench e2e docs

test:            ## the CPU test-suite (what CI runs)
	$(PY) -m pytest tests -q --forked -n 2

train:           ## the example job, every feature on
	deepspeed examples/train.py --deepspeed_config configs/fused_all.json --model qwen3-moe-tiny --steps 20

gpu-test:        ## the GPU-only tests (README: each body in a clean worker, 4 pytest workers)
	$(PY) -m pytest tests/gpu -q -n 4 --forked

bench:           ## the kernel suites (GPU)
	$(PY) -m deepspeed_fused.bench ceilings rms_norm moe_reorder linear_cross_entropy rope mlp_act grad_norm

e2e:             ## the end-to-end training benchmark (GPU)
	$(PY) -m deepspeed_fused.bench e2e

docs:            ## regenerate the config reference in docs/config.md
	$(PY) -m deepspeed_fused.docs --write docs/config.md
