"""Constants of the sparse formats, defined once for the torch code and the CUDA sources.

The CUDA sources see them as #define lines that `sparse_llm.cuda.runtime` puts in front of every source
(`sparse_llm.cuda.kernel_constants.cuda_defines`), so the Python and CUDA sides cannot disagree.
"""

TILE = 256  # gate columns per TwELL tile
SLOTS = 32  # uint32 words per (token, tile) segment: a count, then up to SLOTS - 1 entries
MAX_N = 1 << 16  # TwELL entries hold 16-bit column indices
