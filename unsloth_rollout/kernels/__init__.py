"""C++ CPU kernels of the engine and their build (``build.py``)."""
