"""Kernel checks run in a subprocess (TRITON_INTERPRET=1 on CPU), so the interpreter never leaks into other tests."""
