"""The engine's own kernels: C++ CPU kernels and their build (``build.py``), and the Triton paged decode attention
(``paged_decode.py``, imported only when launched)."""
