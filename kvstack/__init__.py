"""kvstack: a fork-and-patch distribution of vLLM and LMCache.

The package root imports nothing heavy: the tooling (fetch, patch stack,
doctor) runs on a bare Python before torch or vLLM exist.
"""

__version__ = "0.1.0"
