"""The CUDA backend: CuPy RawModule launches of memra's .cu kernels.

One module per kernel file: `backend/cuda/X.py` launches `kernels_cu/X.cu` (dense, norm, hyper,
kda, mla, moe, philox); runtime.py compiles and launches, graphs.py captures and replays walks,
backend.py composes the families into `CudaBackend`.
"""

from memra.backend.cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
