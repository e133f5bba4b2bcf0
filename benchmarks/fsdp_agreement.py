"""FSDP2 (NCCL, one process per GPU) against the single-process trainer engine on a GPU.

Run on a machine with 2 GPUs: `python3 benchmarks/fsdp_agreement.py out.json`. Prints, per
precision, the largest |Δ| of logprobs and entropies, the share of identical routed experts, and
whether the fingerprints match (docs/engines.md quotes the result on two H200s). On the CPU the
same comparison runs with gloo in tests/test_engines_fsdp.py.
"""

import json
import sys
import time
import numpy as np
from rollmarket.engines import TrainerEngine
from rollmarket.engines.fsdp import score_with_fsdp, fingerprint_with_fsdp

def main():
    rng = np.random.default_rng(0)
    shapes = [(30, 25), (3, 1), (12, 40), (7, 9), (1, 17)]
    pairs = [(rng.integers(3, 1500, p).tolist(), rng.integers(3, 1500, r).tolist()) for p, r in shapes]
    out = {}
    for prec in ["fp32", "bf16"]:
        t = time.time()
        fsdp = score_with_fsdp("models/tiny-moe", prec, pairs, world_size=2)
        wall = time.time() - t
        single_engine = TrainerEngine.from_path("models/tiny-moe", prec, device="cuda:0")
        single = single_engine.score_batch(pairs)
        lp = max(float(np.abs(a.logprobs_T - b.logprobs_T).max()) for a, b in zip(fsdp, single))
        ent = max(float(np.abs(a.entropies_T - b.entropies_T).max()) for a, b in zip(fsdp, single))
        ex = float(np.mean([(a.routed_experts_TLK == b.routed_experts_TLK).all(-1).mean() for a, b in zip(fsdp, single)]))
        fp_fsdp = fingerprint_with_fsdp("models/tiny-moe", prec, world_size=2)
        fp_single = single_engine.fingerprint()
        out[prec] = dict(max_abs_logprob=lp, max_abs_entropy=ent, experts_agree=ex, lengths_ok=[a.logprobs_T.size for a in fsdp] == [len(r) for _, r in pairs],
                         fingerprint_equal=fp_fsdp == fp_single, fsdp_wall_s=wall)
        print(prec, out[prec], flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=2)

if __name__ == "__main__":
    main()
