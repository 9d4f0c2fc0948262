import subprocess
import sys

_SCRIPT = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
import moebus.kernels as K

assert not K.HAS_TRITON
x = torch.randn(3, 16)
# CPU dispatch is the C kernel (or the reference when no compiler): equal up to rounding
torch.testing.assert_close(K.rms_norm(x, torch.ones(16), 1e-6), K.rms_norm_ref(x, torch.ones(16), 1e-6))
assert K.silu_and_mul(x).shape == (3, 8)
try:
    K.rms_norm_triton(x, torch.ones(16), 1e-6)
except RuntimeError as e:
    assert "triton is not installed" in str(e)
else:
    raise AssertionError("expected RuntimeError")
"""


def test_kernels_import_and_dispatch_without_triton():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
