"""Dropout forwards + backwards (varlen, several key blocks each) against the reference given the mask: the sweep
compute-sanitizer runs over flash_fwd_sm90's keep ring."""
import sys

sys.path.insert(0, "bench")
from sanitize_cases import run_variant_case  # noqa: E402

CASES = [("float16", 64, (300, 5), (517, 260), 2, 1, dict(causal=True, dropout_p=0.2)),
         ("bfloat16", 128, (300, 130), (517, 390), 2, 2, dict(dropout_p=0.3)),
         ("bfloat16", 256, (200,), (333,), 2, 1, dict(causal=True, dropout_p=0.25))]
fails = []
for i, case in [(j, CASES[j]) for j in map(int, sys.argv[1:] or range(len(CASES)))]:
    fails += run_variant_case(*case, seed=40 + i)
print("\n".join(fails) or "keep_ring: all cases match the reference")
sys.exit(1 if fails else 0)
