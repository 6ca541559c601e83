"""Host cost of one Triton launch in Triton 3.6, piece by piece (run on the GPU machine).

    PYTHONPATH=src python scripts/launch_overhead.py
"""

import torch
from triton.runtime import driver

from tilefuse.bench import host_us
from tilefuse.ops import softmax as sm


x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)   # tiny: host-bound on purpose
y = torch.empty_like(x)
k = sm.softmax_fwd_fused_kernel
args = (x, y, x.stride(0), y.stride(0), 64, 1024)
kw = dict(LOG=False, BLOCK_M=2, BLOCK_N=1024, num_warps=4)
grid = (32,)
compiled = k[grid](*args, **kw)
full = args + (False, 2, 1024)
dev = torch.cuda.current_device()
stream = driver.active.get_current_stream(dev)
kernel_cache, kernel_key_cache, target, backend, binder = k.fn.device_caches[dev]
print(f"Triton's kernel[grid](...)            {host_us(lambda: k.fn[grid](*args, **kw)):7.1f} us")
print(f"tilefuse fast_launch kernel[grid](...) {host_us(lambda: k[grid](*args, **kw)):7.1f} us")
print(f"binder(...) only                      {host_us(lambda: binder(*args, **kw)):7.1f} us")
print(f"compiled[grid](*all_args, stream=s)   {host_us(lambda: compiled[(32, 1, 1)](*full, stream=stream)):7.1f} us")
run, fn, meta = compiled.run, compiled.function, compiled.packed_metadata
print(f"compiled.run(...) direct              {host_us(lambda: run(32, 1, 1, stream, fn, meta, None, None, None, *full)):7.1f} us")
print(f"get_current_stream                    {host_us(lambda: driver.active.get_current_stream(dev)):7.1f} us")
print(f"torch.empty_like                      {host_us(lambda: torch.empty_like(x)):7.1f} us")
print(f"torch.softmax (no grad)               {host_us(lambda: torch.softmax(x, -1)):7.1f} us")
