"""llmnote's kernels: one op per file, each with ``<op>_ref`` in plain PyTorch
taking the same arguments, the Triton kernel(s) and a validating launcher."""

from llmnote.ops.softmax import softmax, softmax_ref
from llmnote.ops.vector_add import vector_add, vector_add_ref

__all__ = ["softmax", "softmax_ref", "vector_add", "vector_add_ref"]
