//! CUDA sources of the kernel library. (Filled in by the CUDA backend work.)
