"""Run the region kernels under Triton's CPU interpreter and print the checks as JSON.

Run in a fresh process with ``TRITON_INTERPRET=1`` (the variable is read when the kernels
are defined). The interpreter's BF16 conversion is not round-to-nearest, so these are
structure and tolerance checks; the bitwise ones need a GPU (tests/test_kernels.py).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from rpa.core import numerics  # noqa: E402
from rpa.core.kernels import triton_regions as k  # noqa: E402
from tests import kernel_checks as kc  # noqa: E402

assert os.environ.get("TRITON_INTERPRET") == "1" and not k.IEEE
t = kc.inputs("cpu", rows=24, hidden=96, inter=160, heads=3, head_dim=32)
ref64 = kc.references64(t)
got = kc.forward_outputs(k, t)
ref = kc.forward_outputs(numerics, t)
report = {"vs_fp64": {n: kc.vs_fp64(got[n], ref64[n]) for n in ref64},
          "vs_reference": {n: kc.bitwise(got[n], ref[n]) for n in ref},
          "shapes_dtypes": all(got[n].shape == ref[n].shape and got[n].dtype == ref[n].dtype for n in ref)}
# strided inputs as vLLM passes them (gate/up halves of one [rows, 2 * inter] tensor)
merged = torch.cat((t["g"], t["u"]), dim=-1)
report["strided_swiglu_equal"] = torch.equal(k.swiglu(merged[:, :160], merged[:, 160:]), got["swiglu"])
report["batch_invariant"] = {
    "rms_norm": kc.batch_invariance(lambda x: k.rms_norm(x, t["w"], 1e-6), t["x"], (1, 5, 24)),
    "swiglu": kc.batch_invariance(lambda g: k.swiglu(g, t["u"][: g.shape[0]]), t["g"], (1, 5, 24)),
}
report["backward_rel_err"] = kc.backward_errors(k, t)
q_back = k.rope(k.rope(t["q"], t["cos"], t["sin"]), t["cos"], -t["sin"])
report["rope_inverse_rel_err"] = kc.rel_err(q_back, t["q"])
print(json.dumps(report))
