"""asyncpaged: an LLM inference engine for your own event loop, on a paged KV cache."""

from asyncpaged.core import BlockPool

__version__ = "0.1.0"

__all__ = ["BlockPool", "__version__"]
