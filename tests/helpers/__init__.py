"""Helpers shared by several test folders (and scripts/gpu_check.py).

- targets: the tiny HF targets behind conftest.py's fixtures, random prompts, greedy
  references from transformers;
- drafters: tiny targets, speculators drafters and their PyTorch references (parity tests);
- spec_e2e: the planted-feature target and drafters of the end-to-end speculative tests;
- default_model: the tiny random Llama (byte-level tokenizer) built on first use;
- gpu_lines: the checkpoints of the GPU check's lines (tests/gpu), built and found;
- serve: a real ``python -m jspec.serve`` subprocess, /metrics parsing;
- engine: an engine driven by hand, requests added and aborted at chosen steps;
- lowering: the custom calls (Pallas kernels) of a function lowered for GPU or TPU;
- sampling: reference loops that apply the logits processors to transformers' logits;
- structured: the varied JSON schemas of the structured-outputs tests, and their validator;
- buckets: fewer shape buckets for the CPU tests' engines (conftest.py), and for the
  child processes they start;
- parallel: 8-head Llama / Qwen3 targets and their drafters, engines cached per tensor
  parallel size (tests/parallel).
"""
