"""Child process of test_dynamo_inductor_cache: compile qdq with Inductor, print counters."""

import json

import quant_dynamo
import torch
from quant_core import NVFP4Quantizer
from torch._dynamo.utils import counters


def fn(x, q):
    return quant_dynamo.qdq(x, q) * 2


g = torch.Generator().manual_seed(0)
x = torch.randn(128, 256, generator=g).to(torch.bfloat16)
q = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
out = torch.compile(fn, fullgraph=quant_dynamo.compile_supported())(x, q)
same = torch.equal(out.view(torch.int16), fn(x, q).view(torch.int16))
print(json.dumps({
    "same": same,
    "hit": counters["inductor"]["fxgraph_cache_hit"],
    "miss": counters["inductor"]["fxgraph_cache_miss"],
}))
