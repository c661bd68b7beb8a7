"""Helpers shared by several test folders (and scripts/gpu_check.py).

- targets: the tiny HF targets behind conftest.py's fixtures, random prompts;
- drafters: tiny targets, speculators drafters and their PyTorch references (parity tests);
- spec_e2e: the planted-feature target and drafters of the end-to-end speculative tests;
- serve: a real ``python -m jspec.serve`` subprocess, /metrics parsing.
"""
