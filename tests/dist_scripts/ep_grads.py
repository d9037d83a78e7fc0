"""Run under torchrun (2 processes, gloo): expert-parallel forward and gradients vs one process.

Every rank also builds the unsharded model from the same seed, runs the *global* batch through
it alone, and checks that the sharded model's outputs (its rows) and gradients (experts: its
shard; others: all of them) match within 1e-5. Prints OK on success, exits 1 otherwise.
"""

import sys

import torch
import torch.distributed as dist

from conceptmoe import ModelConfig, build_model
from conceptmoe.parallel import distributed, expert_parallel

kind = sys.argv[1]
d = distributed.setup("cpu")
cfg = ModelConfig.from_preset("tiny", kind=kind, n_experts=8, top_k=2)
torch.manual_seed(0)
ref = build_model(cfg).train()
torch.manual_seed(0)
model = distributed.parallelize(build_model(cfg).train(), d, "ddp", "fp32", experts=2)
g = torch.Generator().manual_seed(1)
x = torch.randint(0, cfg.vocab_size, (4, 24), generator=g)
u = torch.rand(4, 24, generator=g)
extra = lambda rows: {"boundary_noise": u[rows]} if cfg.is_concept else {}  # noqa: E731

out_ref = ref(x, labels=x, **extra(slice(None)))
out_ref.loss.backward()
rows = slice(2 * d.rank, 2 * d.rank + 2)
out = model(x[rows], labels=x[rows], **extra(rows))
out.loss.backward()
expert_parallel.sync_grads(model, d.world)

worst = (out.logits - out_ref.logits[rows]).abs().max().item()
ep = model.expert_parallel
ref_params = dict(ref.named_parameters())
for name, p in model.named_parameters():
    want = ref_params[name].grad
    if expert_parallel.is_expert(name):
        want = want[expert_parallel._local(want.shape[0], ep)]
    worst = max(worst, (p.grad - want).abs().max().item())
loss = d.mean(float(out.loss))
worst = max(worst, abs(loss - float(out_ref.loss)))
print(f"rank {d.rank} max diff {worst:.2e}")
ok = worst < 1e-5
dist.barrier()
distributed.teardown(d)
sys.exit(0 if ok else 1)
