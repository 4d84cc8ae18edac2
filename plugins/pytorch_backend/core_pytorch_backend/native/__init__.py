"""The plugin's own CPU kernels in C (``csrc/``): built on first use (``build``), loaded through ctypes
(``library``), used by the ``native`` op set (``kernels/native.py``) and ``NativeWeight``."""
