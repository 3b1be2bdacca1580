"""Triton kernels for decode, one file per kernel: import each launcher from its own module
(`from ocriaquant.runtime.kernels.gemv_fp8 import gemv_fp8`). Importing a kernel module needs
Triton; on the CPU the kernels run under TRITON_INTERPRET=1 (what CI checks, at small shapes).

Two modules import no Triton, so that the torch backend can use them where Triton is not
installed: reference.py, the plain-torch reference of every kernel (what the tests compare
against), and partials.py, the split-K Partials type the layers and the kernels share.

This package imports nothing itself, and nothing in it imports code of ours outside it."""
