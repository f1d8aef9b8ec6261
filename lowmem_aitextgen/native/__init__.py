"""Our own C kernels (csrc/), built at first use, and their ctypes wrappers."""
