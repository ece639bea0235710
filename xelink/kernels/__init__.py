"""Local kernels: a Triton kernel per op plus its pure-torch ``reference_*`` twin.

Modules import without Triton; a kernel that needs Triton raises a clear error when called without it.
"""

__all__: list[str] = []
