"""The int4 GEMV (M = 1) or small-M kernel under Nsight Compute: what its warps wait on (GPU machine).

    ncu --kernel-name regex:quant_gemv --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python scripts/int4_gemv_ncu.py [N K [M]]

Runs the default launch (``quant_linear``, bf16 x, group 128) three times on an [N, K] weight
(14336×4096 unless given) with M rows of x (1 unless given: M = 2-16 takes the Hopper wgmma kernel,
``int4_wgmma_kernel``). ``scripts/int4_ncu_source.sh`` runs the full set with per-instruction stall
samples and prints them.
"""

import sys

import torch

from tilefuse.ops.quant import quant_linear, quantize_weight

n, k = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (14336, 4096)
m = int(sys.argv[3]) if len(sys.argv) > 3 else 1
qw = quantize_weight((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16(), 4, 128)
x = torch.randn(m, k, device="cuda").bfloat16()
for _ in range(3):
    quant_linear(x, qw)
torch.cuda.synchronize()
