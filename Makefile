# CPU install path: pins the CPU build of torch (GPU users install their own CUDA/ROCm torch first, then
# `pip install -e ".[train]"`).
PY ?= python3
TORCH_CPU ?= torch==2.13.0
TRITON_CPU ?= triton==3.8.0

.PHONY: install test plans bench-solve

install:
	$(PY) -m pip install -q "$(TORCH_CPU)" "$(TRITON_CPU)"
	$(PY) -m pip install -q -e ".[train,test,hf,data,plot]"

test:
	$(PY) -m pytest -x -q tests
	recipe check plans/

plans:
	$(PY) -m recipe.gen_plans plans/

bench-solve:
	$(PY) bench/bench_solve.py
