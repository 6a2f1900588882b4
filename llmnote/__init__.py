"""llmnote: the code behind the llmnote book.

Importing llmnote chooses how kernels run (see :mod:`llmnote.device`) *before*
any ``@triton.jit`` function in the package is defined: on a machine without a
CUDA GPU it sets ``TRITON_INTERPRET=1`` (unless the user already set it), so the
same Triton kernels run in Triton's CPU interpreter.
"""

from llmnote import device  # must come first: it may set TRITON_INTERPRET
from llmnote import ops, testing  # noqa: E402

__version__ = "0.1.0"

__all__ = ["device", "ops", "testing", "__version__"]
