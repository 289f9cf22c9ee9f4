"""postrl's fused CPU kernels in C: the build that compiles and caches them (``build.py``), the
vector math they share (``simd.h``) and the training kernels with their autograd functions
(``train.c``, ``train.py``). Imports torch only; the engines (``engine/``, ``rollout/``) use it."""
