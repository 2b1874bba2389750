"""PersonaPlex served on Triton Inference Server.

Importing the package is cheap (no torch): clients use `personaplex_triton.contract` alone.
"""

__version__ = "0.1.0"
