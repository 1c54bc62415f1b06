from .jit import JITFunction as JITFunction
from .jit import KernelInterface as KernelInterface
