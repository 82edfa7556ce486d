"""Triton kernels for tree speculative decoding (installed as ``ubtree_vllm.triton_ops``).

Nothing is exported yet.  The tree-attention, on-device tree-acceptance and
state-copy kernels arrive with the GPU fast-path issue, each as a private
``_*_kernel``, a public launcher that asserts its shape/stride/dtype contract,
and a pure-torch twin in ``triton_ops/reference.py`` used as test oracle and
CPU fallback.  Triton will be imported through ``vllm.triton_utils`` so that
CPU-only environments can still import this package.
"""
