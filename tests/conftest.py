import os

import torch

# Triton kernels run in the interpreter on a CPU; it must be on before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
